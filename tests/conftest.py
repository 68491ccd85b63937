pytest_plugins = ["tests.servers", "tests.mooncake_server"]


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: object, items: list[object]) -> None:
    """Tests marked ``gpu`` are skipped on machines without a CUDA device."""
    import pytest

    if any("gpu" in item.keywords for item in items) and not _cuda_available():  # type: ignore[attr-defined]
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:  # type: ignore[attr-defined]
                item.add_marker(skip)  # type: ignore[attr-defined]
