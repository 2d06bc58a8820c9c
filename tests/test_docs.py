"""Docs stay in step with the code: every catalogue metric is documented."""

from conftest import ROOT
from moescope.metrics import catalogue


def test_metrics_doc_names_every_catalogue_metric():
    doc = (ROOT / "docs" / "metrics.md").read_text()
    missing = [m.name for m in catalogue.CATALOGUE if f"`{m.name}`" not in doc]
    assert not missing, missing
