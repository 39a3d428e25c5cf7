"""The local vLLM launcher's weights type: float32 on a CPU without native bfloat16, else vLLM's choice."""

from __future__ import annotations

from pathlib import Path

from usefulwork.backends import local
from usefulwork.backends.local import LocalVLLM, cpu_lacks_bf16

AVX2 = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


def test_cpu_lacks_bf16_reads_the_cpu_flags_and_a_gpu_device(tmp_path: Path):
    avx2, spr, gpu = tmp_path / "avx2", tmp_path / "spr", tmp_path / "nvidia0"
    avx2.write_text(AVX2)
    spr.write_text(SAPPHIRE)
    none = str(tmp_path / "absent")
    assert cpu_lacks_bf16(str(avx2), none)
    assert not cpu_lacks_bf16(str(spr), none)
    gpu.write_text("")
    assert not cpu_lacks_bf16(str(avx2), str(gpu))  # vLLM runs on the GPU: its own dtype choice
    assert not cpu_lacks_bf16(none, none)  # unreadable: leave vLLM's default


def test_the_command_asks_for_float32_only_when_auto_and_the_cpu_lacks_bf16(monkeypatch):
    srv = LocalVLLM(model_dir=Path("/m"))
    monkeypatch.setattr(local, "cpu_lacks_bf16", lambda: True)
    cmd = srv.command()
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    monkeypatch.setattr(local, "cpu_lacks_bf16", lambda: False)
    assert "--dtype" not in srv.command()
    pinned = LocalVLLM(model_dir=Path("/m"), extra_args=["--dtype=bfloat16"])
    monkeypatch.setattr(local, "cpu_lacks_bf16", lambda: True)
    assert [a for a in pinned.command() if a.startswith("--dtype")] == ["--dtype=bfloat16"]  # extra_args win
    chosen = LocalVLLM(model_dir=Path("/m"), dtype="bfloat16").command()
    assert chosen[chosen.index("--dtype") + 1] == "bfloat16"
