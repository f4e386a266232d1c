"""The servers the online benchmarks start: pagedspec's ``python -m pagedspec.serve`` and the peer,
HF transformers' ``transformers serve --continuous-batching``, each a subprocess on a free
127.0.0.1 port, plus what the soak reads from one (resident memory, Prometheus metrics)."""

import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

SYSTEMS = ("pagedspec", "transformers")
# What each server reads as "ignore EOS": vLLM's extra field; transformers serve rejects unknown
# fields but takes a per-request GenerationConfig, and no token has id -1.
IGNORE_EOS = {
    "pagedspec": {"ignore_eos": True},
    "transformers": {"generation_config": json.dumps({"eos_token_id": -1})},
}


def scratch_dir() -> Path:
    """Where the benchmarks put server logs and the peer's model directory (not the results)."""
    path = Path(tempfile.gettempdir()) / "pagedspec-bench"
    path.mkdir(exist_ok=True)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_model_dir(model_dir: str, out: Path) -> str:
    """``model_dir`` as ``transformers serve`` loads it: its config must name the architecture
    (the default model's, converted from GGUF, does not); the other files are linked."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if config.get("architectures"):
        return model_dir
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    config["architectures"] = ["LlamaForCausalLM"]  # the converter writes Llama-family only
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return str(out)


def command(system: str, model_dir: str, port: int, extra: str = "") -> list[str]:
    """The command line that serves ``model_dir`` on ``port`` (``extra``: more flags)."""
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if system == "pagedspec":
        argv = [sys.executable, "-m", "pagedspec.serve", "--model", model_dir, *host]
    elif system == "transformers":
        cli = Path(sys.executable).with_name("transformers")
        argv = [str(cli), "serve", model_dir, "--continuous-batching", *host]
    else:
        raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}")
    return argv + shlex.split(extra)


def shown(argv: list[str]) -> str:
    """A server's command line as a person types it (``python``, ``transformers``)."""
    name = Path(argv[0]).name
    return shlex.join(["python" if name.startswith("python") else name, *argv[1:]])


class Server:
    """A server subprocess, started and awaited on ``/health`` by ``with``; stopped by SIGTERM
    (killed if it has not exited after ``grace_s``). Its output goes to ``log_path``."""

    def __init__(self, argv: list[str], log_path: Path, start_timeout_s: float = 600.0) -> None:
        self.argv, self.log_path, self.start_timeout_s = argv, log_path, start_timeout_s
        port = argv[argv.index("--port") + 1]
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Server":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            env = os.environ | {"HF_HUB_OFFLINE": "1"}
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{shlex.join(self.argv)} exited: see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{shlex.join(self.argv)} not healthy after {self.start_timeout_s} s")

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after ``grace_s``; the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.terminate()
        try:
            return self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def model_id(self) -> str:
        """The first model ``/v1/models`` lists (what requests name)."""
        return httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"]

    def rss_bytes(self) -> int:
        """The server process's resident memory (VmRSS)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for process {self.proc.pid}")

    def metrics(self) -> dict[str, float]:
        """``/metrics`` parsed as Prometheus text."""
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=30).text)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{label="v",...}': value} (labels sorted; none: just the name)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out
