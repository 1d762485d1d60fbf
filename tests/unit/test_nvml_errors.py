"""vgpu.nvml's MIG look-ups called directly over a stand-in pynvml that knows one GPU: a
record naming its GPU by UUID, by index alone, or by neither is answered with a
DeviceError or the instances, never a library traceback."""
import pytest

from vgpu import nvml


class OneGpu:
    """The calls instances_by_id makes, on a GPU with no GPU instance 3 (NOT_FOUND)."""
    NVML_ERROR_NOT_FOUND = 6

    class NVMLError(Exception):
        def __init__(self, value):
            self.value = value

        def __str__(self):
            return "Not Found"

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid != "GPU-0":
            raise self.NVMLError(self.NVML_ERROR_NOT_FOUND)
        return "gpu0"

    def nvmlDeviceGetHandleByIndex(self, index):
        if index != 0:
            raise self.NVMLError(2)
        return "gpu0"

    def nvmlDeviceGetGpuInstanceById(self, h, gi):
        raise self.NVMLError(self.NVML_ERROR_NOT_FOUND)


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(nvml, "_nvml", OneGpu)


def test_a_record_naming_its_gpu_by_uuid_or_by_index_alone_is_looked_up(one_gpu):
    assert nvml.instances_by_id(3, 0, uuid="GPU-0") == (None, None)
    assert nvml.instances_by_id(3, 0, uuid="GPU-gone", index=0) == (None, None)
    assert nvml.instances_by_id(3, 0, index=0) == (None, None)


def test_a_record_naming_no_gpu_or_one_not_here_is_a_device_error(one_gpu):
    with pytest.raises(nvml.DeviceError, match="neither a UUID nor an index"):
        nvml.instances_by_id(3, 0)
    with pytest.raises(nvml.DeviceError) as e:
        nvml.instances_by_id(3, 0, uuid="GPU-gone", index=5)
    assert e.value.reason == "invalid_argument" and e.value.code == 2
