"""The tests' shared harness, imported as tests.helpers by the suite and the benchmarks alike
(pyproject.toml puts the repository root on the path):

  paths       the repository's places the tests read (ROOT, csrc/, tests/programs/, fixtures)
  simnode     a simulated node: the environment of a child bound to a fresh simgpu node,
              Python children run in it, a slice's usage counters staged by hand
  children    JsonChild, a long-running child answering JSON lines
  wait        polling until something holds (wait_until), until a process has exited
  containers  a process in its own mount namespace: containers without an engine
  prometheus  a real Prometheus and promtool (Debian's package)
  k8s/        the Kubernetes stand-ins: the fake API server, the control plane's
              controllers and scheduler, the kubelet, CDI as the runtimes read it, CEL,
              the API server's defaults, the client's models, a manifest schema check, and
              a simulated DRA node running the real agent

conftest.py keeps the fixtures and the suite's guard; everything a test imports is here.
"""
