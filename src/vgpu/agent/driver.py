"""The Observer's look at the driver: where NVML lists which processes, GPUs and MIG devices."""


from .model import Place, record_place
from .settings import MIG_FORCED_S, MIG_RESCAN_S


class DriverLook:
    """(Observer) one look at NVML per place."""

    def _driver(self, now):
        """(ok, note, {Place: {host pid: bytes}}, {Place: {host pid: SM percent}}, {Place: why})
        from one look at NVML.  A GPU in MIG mode has no processes of its own: they are on
        its MIG devices, each read through its own handle; per-process utilization is not
        there (NOT_SUPPORTED on a MIG-enabled GPU), so its places have none."""
        ok, note = (self.nvml.available() if self.use_nvml else (False, "NVML not used"))
        per_place, util, errors = {}, {}, {}
        if not ok:
            return ok, note, per_place, util, errors
        try:
            count = self.nvml.device_count()
        except Exception as e:   # a driver going away
            return False, str(e), per_place, util, errors
        mig_enabled = getattr(self.nvml, "mig_enabled", None)
        for d in range(count):
            whole = self._gpu_places.get(d)
            if whole is None:
                whole = self._gpu_places[d] = Place(d)
            on = None
            if mig_enabled is not None and d not in self._no_mig:
                try:
                    on = mig_enabled(d)
                except Exception:    # its mode unknown this once: as it was at the last look
                    on = d in self._migs
                if on is None:
                    self._no_mig.add(d)
            if not on:
                if d in self._migs:
                    self._forget_migs(d)
                try:
                    per_place[whole] = self.nvml.running_processes(d)
                except Exception as e:
                    errors[whole] = str(e)
                    continue
                try:
                    util[whole] = self.nvml.process_utilization(d)
                except Exception:
                    util[whole] = {}
                continue
            self._mig_view(d, now, per_place, errors)
        return ok, note, per_place, util, errors

    def _mig_view(self, d, now, per_place, errors):
        """The processes of GPU d's MIG devices (listed again when one stops answering, when
        the GPU's own aggregate list names a process none of them has -- an instance made
        since -- and every MIG_RESCAN_S)."""
        listed = self._migs.get(d)
        if listed is None or now - listed[0] >= MIG_RESCAN_S:
            listed = self._list_migs(d, now, errors)
        for attempt in (0, 1):
            found, failed = {}, False
            for m in listed[1]:
                p = self.mig_places[m.uuid]
                try:
                    found[p] = self.nvml.mig_processes(m)
                    errors.pop(p, None)
                except Exception as e:
                    errors[p] = str(e)
                    failed = True
            try:             # (the aggregate needs privileges: without them, only the rescans)
                everyone = self.nvml.running_processes(d)
            except Exception:
                everyone = {}
            missing = set(everyone).difference(*found.values()) if everyone else ()
            if attempt == 0 and (failed or missing) and now - self._mig_forced.get(d, -1e9) >= MIG_FORCED_S:
                self._mig_forced[d] = now
                for p in [p for p in errors if p.gpu == d and p.mig is not None]:
                    del errors[p]
                listed = self._list_migs(d, now, errors)
                continue
            break
        per_place.update(found)

    def _list_migs(self, d, now, errors):
        try:
            devices = self.nvml.mig_devices(d)
        except Exception as e:
            errors[self._gpu_places[d]] = str(e)
            devices = []
        for m in (self._migs.get(d) or (0, []))[1]:
            self.mig_places.pop(m.uuid, None)
        for m in devices:
            self.mig_places[m.uuid] = Place(d, m.uuid, m.gpu_instance, m.compute_instance)
        self._migs[d] = (now, devices)
        return self._migs[d]

    def _forget_migs(self, d):
        for m in self._migs.pop(d, (0, []))[1]:
            self.mig_places.pop(m.uuid, None)

    def places_of(self, view) -> dict:
        """{quota device: Place} of a slice: a software slice's device d is GPU d (CUDA's
        ordinals follow NVML's: `env` sets CUDA_DEVICE_ORDER=PCI_BUS_ID and gives every
        GPU); a MIG slice's device 0 is its MIG device, wherever NVML lists it."""
        record = view.mig
        if record is not None:
            return {0: record_place(record, self.mig_places)}
        gp = self._gpu_places
        return {d: gp.get(d) or Place(d) for d, _ in view.held}

    def _place_processes(self, place):
        """{host pid: bytes} NVML lists on one place now."""
        if place.mig is None:
            return self.nvml.running_processes(place.gpu)
        listed = self._migs.get(place.gpu)
        m = next((m for m in (listed[1] if listed else ()) if m.uuid == place.mig), None)
        if m is None:
            raise LookupError(f"MIG device {place.mig} not listed")
        return self.nvml.mig_processes(m)
