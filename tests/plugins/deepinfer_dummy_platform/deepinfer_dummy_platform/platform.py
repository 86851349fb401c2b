"""The dummy platform: a CPU device whose op backend implements one op itself."""

from deepinfer.platform.cpu import CpuPlatform
from deepinfer.platform.interface import Detection


class DummyPlatform(CpuPlatform):
    name = "dummy"
    op_backend = "deepinfer_dummy_platform.ops"

    @classmethod
    def detect(cls) -> Detection:
        return Detection(True, "dummy test device", device_name="dummy0", chip="cpu")
