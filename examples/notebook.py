"""A notebook on simgpu: holds SIZE of device memory and is idle, but for one short
kernel (--kernel-us µs) every --every seconds, as someone trying things out.

    python examples/notebook.py 512Mi
"""
import time

from _workload import Gpu, arguments, run_until_stopped


def main():
    args = arguments(__doc__.splitlines()[0], every=(float, 1.0, "seconds between kernels"),
                     kernel_us=(int, 100, "GPU time of the kernel, µs"))
    gpu = Gpu()
    gpu.hold(args.size)

    def cell():
        gpu.launch(args.kernel_us)
        gpu.sync()
        time.sleep(args.every)

    run_until_stopped(args.seconds, cell)


if __name__ == "__main__":
    main()
