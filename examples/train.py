"""A training job on simgpu: holds SIZE of device memory and runs steps back to back, each
10 kernels of --step-us µs, so it takes all the GPU time its slice allows.

    python examples/train.py 8Gi                 # until stopped
    vgpu-ctl run --name train -- python examples/train.py 8Gi --seconds 60
"""
from _workload import Gpu, arguments, run_until_stopped


def main():
    args = arguments(__doc__.splitlines()[0], step_us=(int, 2000, "GPU time of each of a step's 10 kernels, µs"))
    gpu = Gpu()
    gpu.hold(args.size)

    def step():
        gpu.launch(args.step_us, 10)
        gpu.sync()

    run_until_stopped(args.seconds, step)


if __name__ == "__main__":
    main()
