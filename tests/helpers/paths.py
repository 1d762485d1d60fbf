"""The places in the repository the tests read."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
CSRC = ROOT / "csrc"
PROGRAMS = TESTS / "programs"
# NVIDIA's libcudart 13.0 cuGetProcAddress requests, in call order (recorded data, copied
# from the project's shared fixtures so a clean clone has it).
CUDART13_REQUESTS = TESTS / "fixtures" / "cudart13-getprocaddress.tsv"
