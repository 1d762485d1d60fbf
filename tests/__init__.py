"""The suite is a package, a directory per component, so that everything in it is imported
by its full name whichever file pytest starts from: the shared harness as tests.helpers, a
test module that takes another's pieces as tests.agent.test_node_agent.  (pyproject.toml
puts the repository root on the path, for the benchmarks too.)"""
