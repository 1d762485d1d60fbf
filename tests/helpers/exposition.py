"""The exporter's /metrics text as {(sample name, sorted labels): value}.

Every series with a `slice` label also carries `container`, the label's old name (kept
until the next release): `series` checks the two agree on every sample and drops the old
one, so the tests name each series by its new labels.
"""
from prometheus_client.parser import text_string_to_metric_families


def series(text) -> dict:
    out = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            labels = dict(s.labels)
            if "slice" in labels:
                assert labels.pop("container", None) == labels["slice"], (s.name, s.labels)
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out
