"""An inference service on simgpu: holds SIZE of device memory (the model) and serves
--rps requests a second, each 4 kernels of --kernel-us µs (2 ms of GPU time by default:
10% of the GPU at 50 a second), so it needs a small, steady share of the GPU.

    python examples/serve.py 3Gi --rps 20
"""
import time

from _workload import Gpu, arguments, run_until_stopped


def main():
    args = arguments(__doc__.splitlines()[0], rps=(float, 50.0, "requests a second"),
                     kernel_us=(int, 500, "GPU time of each of a request's 4 kernels, µs"))
    gpu = Gpu()
    gpu.hold(args.size)
    period = 1.0 / args.rps
    next_request = time.monotonic()

    def serve_one():
        nonlocal next_request
        gpu.launch(args.kernel_us, 4)
        gpu.sync()
        next_request += period
        time.sleep(max(0.0, next_request - time.monotonic()))

    run_until_stopped(args.seconds, serve_one)


if __name__ == "__main__":
    main()
