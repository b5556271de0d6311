"""Hugging Face Hub ids (`Qwen/Qwen3-8B`) found in the local Hub cache, without any network access.

rapidserve never downloads: a Hub id is served only when it is already in a cache folder that
`huggingface_hub` (`hf download`, `huggingface-cli download`, a vLLM run) filled. The cache layout
(huggingface_hub's, stable since 2022):

    <cache>/models--<org>--<name>/refs/<revision>      a file holding a commit hash (refs/main, refs/pr/1...)
    <cache>/models--<org>--<name>/snapshots/<commit>/  the repository's files at that commit (links to blobs/)

The cache folder is, first match wins, `--download-dir` (vLLM's flag; then only it), $HF_HUB_CACHE,
$HUGGINGFACE_HUB_CACHE, $HF_HOME/hub, $XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub
(huggingface_hub's own order). A revision is a ref (default `main`) or a commit hash; without a
`refs/main` a cache holding one snapshot is taken (a copied cache often lacks refs/).

Pure file-system code: the environment is passed in (`env`), read by whoever builds the config.
`display_name` is the short name of any model spec (for logs, served names and profile file names).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from rapidserve.loader.source import ModelLoadError

DEFAULT_REVISION = "main"
DUMMY_PREFIX = "dummy:"  # "dummy:<HF folder>": the folder's architecture with random weights (--load-format dummy)
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")
_SNAPSHOT = re.compile(r"models--(?P<repo>.+)/snapshots/[^/]+")


def is_repo_id(spec: str) -> bool:
    """Whether `spec` has the form of a Hub model id (`org/name` or `name`), not of a path or a .gguf file."""
    return (_REPO_ID.fullmatch(spec) is not None and not spec.endswith((".gguf", ".json"))
            and ".." not in spec and not spec.startswith("."))


def hub_cache_dirs(env: Mapping[str, str], download_dir: str | None = None) -> list[str]:
    """The cache folders to look in, in order (`download_dir` alone when given)."""
    if download_dir:
        return [os.path.abspath(os.path.expanduser(download_dir))]
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return [os.path.abspath(os.path.expanduser(env[var]))]
    if env.get("HF_HOME"):
        return [os.path.join(os.path.abspath(os.path.expanduser(env["HF_HOME"])), "hub")]
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [os.path.join(os.path.abspath(base), "huggingface", "hub")]


def repo_folder(cache: str, repo_id: str) -> str:
    return os.path.join(cache, "models--" + repo_id.replace("/", "--"))


def find_snapshot(repo_id: str, revision: str | None, caches: list[str]) -> str:
    """The snapshot folder of `repo_id` at `revision` (None: main) in the first cache that has the repository;
    ModelLoadError saying where it looked and how to get the model otherwise."""
    for cache in caches:
        repo = repo_folder(cache, repo_id)
        if os.path.isdir(repo):
            return _snapshot_in(repo, repo_id, revision)
    looked = ", ".join(repo_folder(c, repo_id) for c in caches)
    raise ModelLoadError(repo_id, f"it is neither a local path nor in the local Hugging Face cache (looked for "
                                  f"{looked}). rapidserve does not download models: fetch it first (`hf download "
                                  f"{repo_id}` or `huggingface-cli download {repo_id}`), point --download-dir or "
                                  "$HF_HOME / $HF_HUB_CACHE at the cache holding it, or pass the model folder's path")


def _snapshot_in(repo: str, repo_id: str, revision: str | None) -> str:
    snapshots = os.path.join(repo, "snapshots")
    have = sorted(os.listdir(snapshots)) if os.path.isdir(snapshots) else []
    want = revision or DEFAULT_REVISION
    ref = os.path.join(repo, "refs", *want.split("/"))
    commit: str | None = None
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            commit = f.read().strip()
    elif want in have:
        commit = want  # a commit hash
    elif revision is None and len(have) == 1:
        commit = have[0]  # no refs/main (a copied cache): its only snapshot
    refs = _refs(repo)
    if commit is None or commit not in have:
        what = f"revision {want!r}" + (f" (commit {commit})" if commit else "")
        raise ModelLoadError(repo_id, f"{what} is not in the local Hugging Face cache {repo} (refs: "
                                      f"{', '.join(refs) or 'none'}; snapshots: {', '.join(have) or 'none'}). "
                                      "rapidserve does not download models: fetch that revision first (`hf download "
                                      f"{repo_id} --revision {want}`), or pass --revision with one of those")
    return os.path.join(snapshots, commit)


def _refs(repo: str) -> list[str]:
    root = os.path.join(repo, "refs")
    out = []
    for folder, _, files in os.walk(root):
        out += [os.path.relpath(os.path.join(folder, f), root).replace(os.sep, "/") for f in files]
    return sorted(out)


def local_model_spec(spec: str | None, revision: str | None, download_dir: str | None,
                     env: Mapping[str, str]) -> str | None:
    """`spec` as something `resolve_model` reads: a Hub id not found as a local path becomes its snapshot
    folder (see the module docstring); anything else is returned as given. A revision or download folder
    given with a spec that is not a Hub id is a ModelLoadError (it would change nothing)."""
    hub = spec is not None and is_repo_id(spec) and not os.path.exists(os.path.expanduser(spec))
    if not hub:
        for flag, value in (("--revision", revision), ("--download-dir", download_dir)):
            if value is not None:
                raise ModelLoadError(str(spec or "default"), f"{flag} applies to Hugging Face Hub ids (such as "
                                                             f"Qwen/Qwen3-8B) found in the local cache; this model is "
                                                             f"not one: drop {flag}")
        return spec
    assert spec is not None
    return find_snapshot(spec, revision, hub_cache_dirs(env, download_dir))


def display_name(spec: str | None) -> str:
    """The short name of a model spec: presets keep 'preset:NAME'; a Hub cache snapshot is its repository's
    name (`Qwen3-8B`), any other path its last component; `dummy:` is the name of what it randomizes."""
    if spec is None or spec in ("", "default"):
        return "SmolLM2-135M-Instruct"
    if spec.startswith("preset:"):
        return spec
    spec = spec.removeprefix(DUMMY_PREFIX)
    norm = os.path.normpath(spec).replace(os.sep, "/")
    m = _SNAPSHOT.search(norm)
    if m is not None and norm.endswith(m.group(0)):
        return m["repo"].split("--")[-1]
    return os.path.basename(norm)
