"""One real SGLang server process for a test module, started the way a user starts it
(`python -m sglang_backend.launch --backend sglang`, through sglang_backend.server_process), stopped
with its whole process group; the prompts and the guidance-agreement bar the real-SGLang modules share."""

from __future__ import annotations

import pytest

from megatron_trace.guidance import GuidanceRecord
from sglang_backend.api import SamplingParams
from sglang_backend.server_process import ServerStartError, SGLangProcess


def start_sglang(
    ckpt: str,
    tmp_path_factory,
    *flags: str,
    defaults: tuple[str, ...] = ("--max-total-tokens", "4096", "--max-running-requests", "16"),
):
    """Start a real SGLang server through our launcher (SGLang's CPU engine here), yield its URL once
    /health answers, stop its process group. `flags` go to the launcher after `defaults`."""
    log_path = tmp_path_factory.mktemp("sglang") / "server.log"
    guidance_dir = tmp_path_factory.mktemp("guidance")
    try:
        srv = SGLangProcess(ckpt, [*defaults, *flags], log_path=log_path, env={"TRACE_GUIDANCE_DIR": str(guidance_dir)})
    except ServerStartError as e:
        pytest.fail(str(e))
    try:
        yield srv.url
    finally:
        srv.stop()


def start_sglang_servers(ckpt: str, tmp_path_factory, flag_sets: dict[str, tuple[str, ...]]):
    """Several real SGLang servers of one checkpoint started at once (their start is mostly
    single-threaded imports, so two cores start three in about the time of two one after another);
    yields {name: url} once every /health answers, stops them all. A start that fails stops the
    others and fails the test with its log."""
    from concurrent.futures import ThreadPoolExecutor

    defaults = ("--max-total-tokens", "4096", "--max-running-requests", "16")

    def start(flags):
        log_path = tmp_path_factory.mktemp("sglang") / "server.log"
        env = {"TRACE_GUIDANCE_DIR": str(tmp_path_factory.mktemp("guidance"))}
        return SGLangProcess(ckpt, [*defaults, *flags], log_path=log_path, env=env)

    with ThreadPoolExecutor(len(flag_sets)) as pool:
        futures = {name: pool.submit(start, flags) for name, flags in flag_sets.items()}
    servers, failed = {}, []
    for name, f in futures.items():
        try:
            servers[name] = f.result()
        except ServerStartError as e:
            failed.append(f"{name}: {e}")
    try:
        if failed:
            pytest.fail("\n".join(failed))
        yield {name: srv.url for name, srv in servers.items()}
    finally:
        for srv in servers.values():
            srv.stop()


PREFIX = [7, 21, 33, 4, 90, 11, 2, 48, 16, 5]  # shared by several prompts: the radix cache reuses it
PROMPTS = [[5, 6, 7, 8], PREFIX + [60, 61], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]]


def greedy(n: int = 1, max_new_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0, n=n, ignore_eos=True)


def guidance_agreement(ra: GuidanceRecord, rb: GuidanceRecord) -> dict[str, float]:
    """Two records of one sample: same sites, positions and shapes (asserted), and how far apart:
    the fraction of equal code bytes and scale bytes, the largest relative S_enc difference."""
    # site order is each writer's first-write order (the engine's C and Python layers differ): compare sets
    assert (ra.mode, ra.num_positions, sorted(ra.sites)) == (rb.mode, rb.num_positions, sorted(rb.sites))
    eq = {"payload": [0, 0], "scale": [0, 0]}
    rel = 0.0
    for name, x in ra.sites.items():
        y = rb.sites[name]
        for field, (same, total) in eq.items():
            u, v = getattr(x, field), getattr(y, field)
            assert u.shape == v.shape, (name, field)
            eq[field] = [same + int((u == v).sum()), total + u.numel()]
        rel = max(rel, float(((x.global_scale - y.global_scale).abs() / y.global_scale.abs()).max()))
    return {"codes": eq["payload"][0] / eq["payload"][1], "scales": eq["scale"][0] / eq["scale"][1], "s_enc_rel": rel}


def check_agreement(stats: dict[str, float]) -> None:
    # fp32 activations of SGLang's kernels (torch_native attention, its norms) and of the engine's C
    # kernels agree to a few ulps, not bit for bit: a code at a rounding boundary may flip.
    print("guidance agreement", stats)
    assert stats["codes"] >= 0.999 and stats["scales"] >= 0.999 and stats["s_enc_rel"] <= 1e-5, stats
