"""The private Lightning names the tracking extra uses (the form of src/cifar_amp/compat.py)."""

from __future__ import annotations


# _convert_params, _flatten_dict (lightning.fabric.utilities.logger): how MLFlowLogger flattens the hyperparameters it logs, so that a continued run knows which params it has. Fails: tests/extras/tracking/test_tracking.py::test_flat_params_are_the_keys_mlflow_logger_logs
def flat_params(params: dict) -> dict:
    from lightning.fabric.utilities.logger import _convert_params, _flatten_dict

    return _flatten_dict(_convert_params(params))


# MLFlowLogger._tracking_uri: the store a logger writes to (no public accessor), which the test of the default store reads. Fails: tests/extras/tracking/test_tracking.py::test_mlflow_default_store_is_sqlite_in_logs_and_a_set_uri_wins
def tracking_uri(logger) -> str:
    return logger._tracking_uri
