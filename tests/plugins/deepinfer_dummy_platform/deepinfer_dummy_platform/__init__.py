"""An out-of-tree platform for tests: registers as ``dummy`` and runs on the CPU."""


def register() -> str:
    return "deepinfer_dummy_platform.platform:DummyPlatform"
