"""Keep credentials out of everything a run leaves behind (logs, provenance, cards, outputs).

Three defences, used together:
- by *name*: environment variables whose name says they hold a secret are redacted;
- by *value*: strings shaped like well-known credentials (and, for single values, long
  high-entropy tokens) are redacted wherever they appear;
- by *known value*: the actual secret values of the current environment are searched for
  verbatim in text (`scrub_text`) and in every file of a run directory (`scan_tree`).
Rules and thresholds: docs/provenance.md ("Credential scrubbing").
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

REDACTED = "<redacted>"

# A name is secret when one of its words (split at _ - . and camelCase) is, or ends with, one of
# these: APIKEY, HFTOKEN and DBPASSWORD match; KEYBOARD, TOKENIZERS_PARALLELISM, AUTHOR do not.
_SECRET_WORDS = (
    "KEY",
    "TOKEN",
    "SECRET",
    "PASSWORD",
    "PASSWD",
    "PASSPHRASE",
    "CREDENTIAL",
    "AUTH",
    "SESSION",
    "COOKIE",
    "PRIVATE",
    "SIGNATURE",
)
_SECRET_EXACT = {"PASS", "PAT", "DSN"}  # only as a whole word (PWD is the working dir: not listed)
# ...unless the name ends in one of these: HF_TOKEN_PATH, SSH_AUTH_SOCK name where a secret lives;
# the location is worth recording (a value that itself looks like a credential is still caught).
_LOCATION_WORDS = {"PATH", "FILE", "DIR", "SOCK", "SOCKET"}
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
# The experiment trackers' credentials (docs/tracking.md), secret whatever the word rules above say:
# W&B's key is 40 hex characters, a shape no rule below recognises, so only its name gives it away.
TRACKER_SECRETS = frozenset(
    {
        "WANDB_API_KEY",
        "WANDB_IDENTITY_TOKEN",
        "MLFLOW_TRACKING_PASSWORD",
        "MLFLOW_TRACKING_TOKEN",
        "MLFLOW_TRACKING_AUTH",
        "DATABRICKS_TOKEN",
        "DATABRICKS_CLIENT_SECRET",
    }
)

# Well-known credential shapes, as (kind, regex) pairs. Every regex starts with a literal so that
# the regex engine can skip ahead with a fast substring search (a leading \b makes a byte scan ~40x
# slower); "not preceded by a word character" is checked separately. Lengths are bounded so that
# matching in overlapping chunks is exact.
_SHAPES: list[tuple[str, str]] = [
    ("huggingface_token", r"hf_[A-Za-z0-9]{20,120}"),
    *[("github_token", p + r"_[A-Za-z0-9]{30,120}") for p in ("ghp", "gho", "ghu", "ghs", "ghr")],
    ("github_token", r"github_pat_[A-Za-z0-9_]{22,255}"),
    ("aws_access_key", r"AKIA[0-9A-Z]{16}(?![0-9A-Za-z])"),
    ("aws_access_key", r"ASIA[0-9A-Z]{16}(?![0-9A-Za-z])"),
    ("openai_key", r"sk-(?:proj-|ant-)?[A-Za-z0-9_-]{20,200}"),
    ("slack_token", r"xox[abposr]-[A-Za-z0-9-]{10,200}"),
    ("jwt", r"eyJ[A-Za-z0-9_-]{8,2000}\.eyJ[A-Za-z0-9_-]{8,2000}\.[A-Za-z0-9_-]{8,2000}"),
    ("private_key", r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----"),
    # scheme://user:password@ -- user and password in printable ASCII only: with "any byte but
    # space : / @ quote" a 7 MB weight file matched by chance about every other run
    ("url_password", r"://[!#-&(-.0-9;-?A-~]{1,100}:[!#-&(-.0-9;-?A-~]{1,200}@"),
]
_ANYWHERE = ("url_password", "private_key")  # kinds that may directly follow a word character
_TEXT_SHAPES = [(kind, re.compile(rx if kind in _ANYWHERE else r"(?<![A-Za-z0-9_])" + rx)) for kind, rx in _SHAPES]
# (kind, regex, must not follow a word character) for byte scans
_BYTE_SHAPES = [(kind, re.compile(rx.encode()), kind not in _ANYWHERE) for kind, rx in _SHAPES]
KINDS = tuple(dict.fromkeys(kind for kind, _ in _SHAPES))
_MAX_MATCH = 6100  # longest match any pattern can produce (the JWT bound), for chunk overlap

# High-entropy tokens: >= 32 characters of the base64/url-safe alphabet, mixing at least two of
# upper case / lower case / digits, not pure hex (sha256 digests and git revisions are fine), with
# Shannon entropy >= 4.0 bits per character. Random base62 text of that length measures ~4.5,
# English words and identifiers ~3-3.8; 64 hex characters cannot exceed log2(16) = 4 anyway.
ENTROPY_MIN_LEN = 32
ENTROPY_BITS = 4.0
_TOKEN = re.compile(rf"[A-Za-z0-9+/=_-]{{{ENTROPY_MIN_LEN},}}")
_HEX = re.compile(r"[0-9a-fA-F-]+")
MIN_KNOWN_LEN = 8  # shorter "secrets" (SESSION_ID=1) would redact half of every log


def _words(name: str) -> list[str]:
    return [w.upper() for w in _WORD.findall(name)]


def is_secret_name(name: str) -> bool:
    if name.upper() in TRACKER_SECRETS:
        return True
    words = _words(name)
    if words and words[-1] in _LOCATION_WORDS:
        return False
    for word in words:
        if word in _SECRET_EXACT:
            return True
        stem = word[:-1] if word.endswith("S") else word  # CREDENTIALS, COOKIES, KEYS
        if any(stem.endswith(s) or word.endswith(s) for s in _SECRET_WORDS):
            return True
    return False


def shannon_entropy(s: str) -> float:
    """Bits per character of the empirical character distribution of s."""
    if not s:
        return 0.0
    n = len(s)
    return -sum(c / n * math.log2(c / n) for c in Counter(s).values())


def _high_entropy(token: str) -> bool:
    if _HEX.fullmatch(token):
        return False
    classes = sum((any(c.isupper() for c in token), any(c.islower() for c in token), any(c.isdigit() for c in token)))
    return classes >= 2 and shannon_entropy(token) >= ENTROPY_BITS


def secret_kinds(value: str, high_entropy: bool = True) -> list[str]:
    """Kinds of credential-looking content in value (empty: nothing found)."""
    kinds = list(dict.fromkeys(kind for kind, rx in _TEXT_SHAPES if rx.search(value)))
    # Paths (run directories, PWD, SLURM_SUBMIT_DIR) are often long and varied but never credentials.
    is_path = value.startswith(("/", "./", "~/"))
    if high_entropy and not kinds and not is_path and any(_high_entropy(t) for t in _TOKEN.findall(value)):
        kinds.append("high_entropy")
    return kinds


def looks_like_secret(value: str) -> bool:
    return bool(secret_kinds(value))


def scrub_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Copy of env with secret-named or secret-looking values replaced by REDACTED."""
    env = os.environ if env is None else env
    return {k: REDACTED if is_secret_name(k) or looks_like_secret(v) else v for k, v in env.items()}


def env_secrets(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """name -> value of the environment's secrets (by name or by shape), at least MIN_KNOWN_LEN long."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if len(v) >= MIN_KNOWN_LEN and (is_secret_name(k) or looks_like_secret(v))}


def _known_values(known: Mapping[str, str] | Iterable[str] | None) -> list[str]:
    values = env_secrets().values() if known is None else (known.values() if isinstance(known, Mapping) else known)
    # longest first, so a secret that contains another is replaced whole
    return sorted({v for v in values if len(v) >= MIN_KNOWN_LEN}, key=len, reverse=True)


def scrub_text(text: str, known_secrets: Mapping[str, str] | Iterable[str] | None = None) -> str:
    """text with every known secret value (default: this environment's) and every credential-shaped
    string replaced by REDACTED. High-entropy tokens are left alone: logs are full of hashes and ids."""
    for value in _known_values(known_secrets):
        text = text.replace(value, REDACTED)
    for _, rx in _TEXT_SHAPES:
        text = rx.sub(REDACTED, text)
    return text


@dataclass(frozen=True)
class Finding:
    path: Path
    line: int  # 1-based; for binary files, 1 + number of b"\n" before the match
    kind: str  # "known:<ENV_NAME>", one of KINDS, "high_entropy"; never the secret itself
    where: str = ""  # inside an HDF5 file: the object path holding it

    def __str__(self) -> str:
        loc = f"{self.path}:{self.line}" + (f" ({self.where})" if self.where else "")
        return f"{loc}: {self.kind}"


_CHUNK = 8 << 20
_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


Needle = tuple[str, "re.Pattern[bytes]", bool]  # kind, regex, must not follow a word character
_WORD_BYTES = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")


def _starts(rx: re.Pattern[bytes], buf: bytes, boundary: bool) -> Iterable[int]:
    for m in rx.finditer(buf):
        if not (boundary and m.start() and buf[m.start() - 1] in _WORD_BYTES):
            yield m.start()


def _scan_bytes(chunks: Iterable[bytes], needles: list[Needle], overlap: int) -> Iterable[tuple[int, str]]:
    """(line, kind) of every match in a stream of chunks; matches spanning chunk edges are found once."""
    tail, lines_before_tail, done = b"", 1, 0  # done: offset into buf up to which matches were reported
    for chunk in chunks:
        buf = tail + chunk
        last = len(chunk) == 0
        limit = len(buf) if last else max(len(buf) - overlap, 0)
        for kind, rx, boundary in needles:
            for start in _starts(rx, buf, boundary):
                if done <= start < limit:
                    yield lines_before_tail + buf.count(b"\n", 0, start), kind
        cut = max(len(buf) - overlap, 0)
        lines_before_tail += buf.count(b"\n", 0, cut)
        tail, done = buf[cut:], limit - cut
        if last:
            return


def _read_chunks(path: Path) -> Iterable[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk
    yield b""


def _numeric_rows(dtype) -> bool:
    """A variable-length numeric dataset (token ids, logprobs per row): nothing there is text."""
    base = h5py.check_vlen_dtype(dtype)
    return isinstance(base, np.dtype) and base.kind not in "SUO"


def _scan_hdf5(path: Path, needles: list[Needle]) -> list[Finding]:
    """Strings stored compressed/filtered inside HDF5 are invisible to a byte scan: walk them."""

    found: list[Finding] = []
    # Any needle at all, in one pass over a dataset's strings joined by NUL (no needle matches a NUL):
    # almost always none, and then no string is searched needle by needle.
    anything = re.compile(b"|".join(b"(?:" + rx.pattern + b")" for _, rx, _ in needles))

    def check(where: str, value) -> None:
        arr = np.asarray(value)
        if arr.dtype.kind not in "SUO":
            return
        texts = [
            item if isinstance(item, bytes) else str(item).encode(errors="replace")
            for item in arr.ravel()
            # a variable-length numeric row (token ids): no text, and str() of it is slow
            if not (isinstance(item, np.ndarray) and item.dtype.kind not in "SUO")
        ]
        if not anything.search(b"\0".join(texts)):
            return
        for data in texts:
            found.extend(Finding(path, 0, kind, where) for kind, rx, b in needles if any(_starts(rx, data, b)))

    def visit(name: str, obj) -> None:
        for key, val in obj.attrs.items():
            check(f"/{name}@{key}", val)
        if isinstance(obj, h5py.Dataset) and obj.dtype.kind in "SUO" and not _numeric_rows(obj.dtype):
            check(f"/{name}", obj[()])

    try:
        with h5py.File(path, "r") as f:
            for key, val in f.attrs.items():
                check(f"/@{key}", val)
            f.visititems(visit)
    except OSError as e:  # a torn or foreign file: the byte scan above still covered it
        found.append(Finding(path, 0, "unreadable_hdf5", str(e).splitlines()[0][:80]))
    return found


def tree_files(root: str | os.PathLike, exclude: Iterable[str | os.PathLike] = ()) -> list[Path]:
    """Every regular file under root (hidden and binary ones too; symlinks not followed), in a
    fixed order, without the directories in `exclude` (paths relative to root)."""
    root = Path(root)
    skip = {root / p for p in exclude}
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if Path(dirpath) / d not in skip)
        out += [p for name in sorted(filenames) if not (p := Path(dirpath) / name).is_symlink() and p.is_file()]
    return out


def scan_files(
    paths: Iterable[Path], known_secrets: Mapping[str, str] | Iterable[str] | None = None, high_entropy: bool = False
) -> list[Finding]:
    """The given files searched for the known secret values (default: this environment's) and
    credential-shaped strings; strings inside HDF5 files too.

    `high_entropy` also flags long random-looking tokens; off by default because run directories
    legitimately hold base64 blobs, so a scan stage that fails the run would fail on noise.
    """
    known = env_secrets() if known_secrets is None else known_secrets
    named = known.items() if isinstance(known, Mapping) else ((f"#{i}", v) for i, v in enumerate(_known_values(known)))
    needles: list[Needle] = [
        (f"known:{name}", re.compile(re.escape(value.encode())), False) for name, value in named if len(value) >= MIN_KNOWN_LEN
    ]
    needles += _BYTE_SHAPES
    overlap = max([_MAX_MATCH] + [len(rx.pattern) for _, rx, _ in needles])
    findings: list[Finding] = []
    for path in paths:
        try:
            hits = set(_scan_bytes(_read_chunks(path), needles, overlap))
        except FileNotFoundError:  # removed since it was listed (a temp file renamed into place): nothing left to leak
            continue
        if high_entropy:
            hits |= _entropy_hits(path)
        findings.extend(Finding(path, line, kind) for line, kind in sorted(hits))
        with open(path, "rb") as f:
            is_hdf5 = f.read(8) == _HDF5_MAGIC
        if is_hdf5:
            findings.extend(_scan_hdf5(path, needles))
    return findings


def scan_tree(
    root: str | os.PathLike, known_secrets: Mapping[str, str] | Iterable[str] | None = None, high_entropy: bool = False
) -> list[Finding]:
    """Every file under root (`tree_files`) searched as `scan_files` does."""
    return scan_files(tree_files(root), known_secrets, high_entropy)


def scan_report(run_dir: str | os.PathLike, exclude: Iterable[str] = (), high_entropy: bool = False) -> dict:
    """What the scan stage and the card stage record (`scan.json`): the directories left out (paths
    relative to run_dir), how many files were searched, and every finding (file, line, kind; never
    the value). No byte count: logs and records hold the run's id and times, so it would differ
    between a run and its reproduction. Which secrets were searched is left out: it depends on the
    environment, not on the run."""
    run_dir = Path(run_dir)
    paths = tree_files(run_dir, exclude)
    findings = scan_files(paths, env_secrets(), high_entropy=high_entropy)
    return {
        "excluded": sorted(str(p) for p in exclude),
        "files": len(paths),
        "high_entropy": bool(high_entropy),
        "findings": [
            {"file": str(f.path.relative_to(run_dir)), "line": f.line, "kind": f.kind, "where": f.where} for f in findings
        ],
    }


def _entropy_hits(path: Path) -> set[tuple[int, str]]:
    hits = set()
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            text = raw.decode("latin-1")
            if any(_high_entropy(t) for t in _TOKEN.findall(text)):
                hits.add((lineno, "high_entropy"))
    return hits
