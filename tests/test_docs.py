"""The README and docs/ stay true: every ```python block runs as written, and every relative link resolves.

A block runs in a fresh Python process whose working directory is an empty temp dir. An HTML comment on the
line before a block chooses what runs first:

- ``<!-- prelude: NAME -->``: the setup code ``PRELUDES[NAME]`` (a 1-rank gloo process group, a tiny
  dataset...), so the block itself reads as a user would write it;
- ``<!-- not-run: REASON -->``: the block is only compiled (it needs a launcher, several processes or a
  cloud store); the reason is required and the number of such blocks is capped.

A ``DeprecationWarning`` pointed at a block's own line (an old keyword or name of ours, or of torch) fails
it: the docs show the current form. Every ``path/to/file.py`` the pages name exists, and every dotted name
of ours (``fastio.pipeline.order``, ``fastcomm.collectives.Residual``) names a module, or a name its module
defines.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_NOT_RUN = 6
BLOCK_TIMEOUT_S = 60

_PROCESS_GROUP = """
import os, tempfile
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1),
                        rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
x, y = torch.randn(16, 64), torch.randn(16, 8)
"""

_TARS = """
import io, tarfile
import numpy as np
os.makedirs("data", exist_ok=True)
for shard in range(4):
    with tarfile.open(f"data/shard-{shard:06d}.tar", "w") as tar:
        for i in range(13):
            for name, payload in ((f"{shard}-{i}.x.npy", None), (f"{shard}-{i}.cls", str(i % 10).encode())):
                if payload is None:
                    buffer = io.BytesIO()
                    np.save(buffer, np.full((3, 8, 8), i, np.uint8))
                    payload = buffer.getvalue()
                info = tarfile.TarInfo(name); info.size = len(payload); tar.addfile(info, io.BytesIO(payload))
"""

_IMAGES = """
import io, os, tarfile
import numpy as np
from PIL import Image
rng = np.random.default_rng(0)
for shard in range(5):
    with tarfile.open(f"imgs-{shard:06d}.tar", "w") as tar:
        for i in range(16):
            image = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (80, 96, 3), dtype=np.uint8)).save(image, format="JPEG")
            members = ((f"{shard}-{i}.jpg", image.getvalue()), (f"{shard}-{i}.cls", str(i % 10).encode()))
            for name, payload in members:
                info = tarfile.TarInfo(name); info.size = len(payload); tar.addfile(info, io.BytesIO(payload))
device = "cuda" if __import__("torch").cuda.is_available() else "cpu"
"""

_TOKENS = """
import numpy as np
import fastio
rng = np.random.default_rng(0)
with fastio.ShardWriter("data/tokens", schema={"tokens": ("int32", None)}, max_samples=50) as w:
    for _ in range(200):
        w.write({"tokens": rng.integers(1, 256, int(rng.integers(5, 300)), dtype=np.int32)})
"""

PRELUDES = {
    "process-group": _PROCESS_GROUP,
    "ddp": _PROCESS_GROUP + "ddp = DDP(model)\n",
    "tars": "import os\n" + _TARS,
    "images": _IMAGES,
    "tokens": _TOKENS,
}

_FENCE = re.compile(r"^```(\w*)\s*$")
# a relative path with a folder (not part of a URL or of an absolute path), and a dotted name of ours
_PATH = re.compile(r"(?<![\w./:-])((?:[\w.-]+/)+[\w.-]+\.py)\b")
_DOTTED = re.compile(r"(?<![\w./-])((?:fastcomm|fastio|benchmarks)(?:\.[A-Za-z_]\w*)+)")
_FILE_SUFFIXES = {"md", "py", "json", "png", "txt"}  # ``benchmarks.md`` is a page, not a module
_NATIVE = {"fastcomm._C", "fastio._C"}  # built by setup.py, not in the tree
_MARK = re.compile(r"^<!--\s*(prelude|not-run):\s*(.*?)\s*-->$")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    code: str
    mark: str | None
    mark_value: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = i + 1
        while not lines[end].startswith("```"):
            end += 1
        previous = lines[i - 1].strip() if i else ""
        mark = _MARK.match(previous)
        found.append(Block(page, i + 1, opening.group(1), "\n".join(lines[i + 1 : end]) + "\n",
                           mark.group(1) if mark else None, mark.group(2) if mark else ""))
        i = end + 1
    return found


BLOCKS = [b for page in PAGES for b in _blocks(page)]
PYTHON_BLOCKS = [b for b in BLOCKS if b.language == "python"]
RUN = [b for b in PYTHON_BLOCKS if b.mark != "not-run"]
NOT_RUN = [b for b in PYTHON_BLOCKS if b.mark == "not-run"]


# Blocks run in processes forked from one server that has imported torch, fastcomm and fastio once (and done
# nothing else): each block still gets a fresh process and namespace, without paying the imports again. The
# server also imports what DDP's constructor (torch._dynamo), fastcomm.fsdp and fastcomm.hooks import on first
# use, ~2 s of CPU a block otherwise, and freezes its heap: a collection in a block then leaves those pages
# unwritten (shared with the server) instead of copying them.
_SERVER = r"""
import gc, json, os, signal, sys, time, traceback, warnings
import numpy, torch, torch._dynamo, fastcomm, fastcomm.fsdp, fastcomm.hooks, fastio
gc.freeze()
for line in sys.stdin:
    job = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        os.chdir(job["cwd"])
        os.environ.update(job["env"])
        out = os.open(job["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1); os.dup2(out, 2)
        rc = 0
        warnings.filterwarnings("error", category=DeprecationWarning, module="__main__")
        try:
            exec(compile(job["code"], job["name"], "exec"), {"__name__": "__main__"})
        except SystemExit as stop:
            rc = stop.code if isinstance(stop.code, int) else 1
        except BaseException:
            traceback.print_exc(); rc = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(rc)
    deadline, status = time.monotonic() + job["timeout"], None
    while status is None:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(raw)
        elif time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL); os.waitpid(pid, 0); status = "timeout"
        else:
            time.sleep(0.02)
    print(json.dumps({"status": status}), flush=True)
"""


@pytest.fixture(scope="module")
def block_server():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env=env, text=True, cwd=ROOT)
    yield server
    server.stdin.close()
    server.wait(timeout=30)


@pytest.mark.parametrize("block", RUN, ids=[b.name for b in RUN])
def test_python_block_runs(block: Block, tmp_path: Path, block_server: subprocess.Popen) -> None:
    prelude = ""
    if block.mark == "prelude":
        assert block.mark_value in PRELUDES, f"{block.name}: unknown prelude {block.mark_value!r}"
        prelude = PRELUDES[block.mark_value]
    output = tmp_path / "output.txt"
    job = {"name": block.name, "code": prelude + "\n" + block.code, "cwd": str(tmp_path),
           "output": str(output), "timeout": BLOCK_TIMEOUT_S,
           "env": {"FASTIO_CACHE": str(tmp_path / "cache")}}
    block_server.stdin.write(json.dumps(job) + "\n")
    block_server.stdin.flush()
    reply = block_server.stdout.readline()
    assert reply, f"{block.name}: the block server died"
    status = json.loads(reply)["status"]
    assert status == 0, f"{block.name} ended with {status}:\n{output.read_text()[-4000:]}"


@pytest.mark.parametrize("block", NOT_RUN, ids=[b.name for b in NOT_RUN])
def test_not_run_block_has_reason_and_compiles(block: Block) -> None:
    assert block.mark_value, f"{block.name}: <!-- not-run: ... --> needs a reason"
    compile(block.code, block.name, "exec")


def test_few_blocks_are_not_run() -> None:
    assert len(NOT_RUN) <= MAX_NOT_RUN, [b.name for b in NOT_RUN]


def test_every_fence_is_tagged() -> None:
    untagged = [b.name for b in BLOCKS if not b.language]
    assert not untagged, f"fences without a language (python, bash, text): {untagged}"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    missing = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        if not (page.parent / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)}: links to missing files: {missing}"


def test_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    opening = "\n".join(lines[:8])
    assert "make bench" in opening and "make test" in opening


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module of the repo, or a name that its deepest module defines at top level
    or lists in ``__all__`` (deeper attributes are not followed)."""
    parts = dotted.split(".")
    path, rest = ROOT / parts[0], parts[1:]
    while rest and path.is_dir():
        if (path / rest[0]).is_dir():
            path = path / rest[0]
        elif (path / f"{rest[0]}.py").is_file():
            path = path / f"{rest[0]}.py"
        else:
            break
        rest = rest[1:]
    if not rest:
        return True
    source = path / "__init__.py" if path.is_dir() else path
    name = re.escape(rest[0])
    defined = rf"^(?:(?:async\s+)?def|class)\s+{name}\b|^{name}\s*[:=]|[\"']{name}[\"']"
    return source.is_file() and re.search(defined, source.read_text(), flags=re.M) is not None


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_named_files_and_modules_exist(page: Path) -> None:
    text = page.read_text()
    missing = [path for path in sorted(set(_PATH.findall(text)))
               if not (ROOT / path).exists() and not (page.parent / path).exists()]  # fmt: skip
    unknown = [name for name in sorted(set(_DOTTED.findall(text)))
               if name.rsplit(".", 1)[-1] not in _FILE_SUFFIXES and name not in _NATIVE
               and not _resolves(name)]  # fmt: skip
    assert not missing, f"{page.relative_to(ROOT)} names files that are not in the repo: {missing}"
    assert not unknown, f"{page.relative_to(ROOT)} names modules or names that are not there: {unknown}"
