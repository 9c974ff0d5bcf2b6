"""The Triton split-K decode kernel against the plain torch path, run by Triton's CPU interpreter.

Triton picks the interpreter when a kernel is defined, so the checks run in a fresh process with
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from background import WORKERS, Background
from shardflow.engine.generate.decode_attention import decode_attention_torch

pytest.importorskip("triton")


def check_kernel() -> None:
    from shardflow.engine.generate.decode_attention import decode_attention_triton, num_splits

    assert os.environ.get("TRITON_INTERPRET") == "1"
    cpu = torch.device("cpu")
    # one wave of 4 SMs x programs_per_sm programs, at most one split per 64-position block
    assert [num_splits(b, k, 300, cpu, programs_per_sm=4) for b, k in ((5, 2), (5, 1), (1, 2), (1, 1))] == [1, 3, 5, 5]
    g = torch.Generator().manual_seed(0)
    # (query heads, KV heads, head dim, dtype, window, rows): GQA groups of 2, 3 (not a power of
    # two) and 8; a head dim that is not a power of two; bf16 as on the GPU; sliding windows; rows
    # split one way, three ways and seven ways (so that splits past a short request's last
    # position are empty).
    cases = [(4, 2, 16, torch.float32, None, 5), (6, 2, 24, torch.float32, 16, 5),
             (8, 1, 32, torch.bfloat16, 100, 5), (4, 2, 16, torch.float32, None, 8)]
    for H, K, d, dtype, window, rows in cases:
        # one position, exact and partial blocks, and a full slot; any slot order
        lengths = torch.tensor([1, 64, 65, 300, 137, 2, 90, 299])[:rows]
        slots = torch.tensor([2, 0, 5, 3, 1, 7, 6, 4])[:rows]
        kc = torch.randn(8, K, 300, d, generator=g).to(dtype)
        vc = torch.randn(8, K, 300, d, generator=g).to(dtype)
        q = torch.randn(rows, H, 8, d, generator=g).to(dtype)[:, :, 3]  # strided like the model's q
        want = decode_attention_torch(q.float(), kc.float(), vc.float(), slots, lengths, window)
        for splits in (1, 3, 7):
            got = decode_attention_triton(q, kc, vc, slots, lengths, window, splits=splits).float()
            # fp32: only the summation order differs; bf16: the output is rounded to bf16.
            atol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got, want, atol=atol, rtol=0,
                                       msg=f"{H} {K} {d} {dtype} {window} {rows} splits {splits}")


def check_shared_prompts() -> None:
    """Rows whose groups share a prompt (``prompts``) give the outputs of reading every row's own
    copy: groups of one row, of three, of PROMPT_ROWS, two adjacent groups with equal prompts,
    rows without a prompt between them, padding rows; one split and several."""
    from shardflow.engine.generate.decode_attention import decode_attention_triton
    from shardflow.perf.sharing import PROMPT_ROWS

    g = torch.Generator().manual_seed(2)
    H, K, d = 4, 2, 16
    # group ids and prompt lengths per row: (0: 1 row, prompt 5), (1: 3 rows, 40), (-1: no prompt),
    # (2: PROMPT_ROWS rows, 64), (3: 2 rows, 64, next to group 2), two padding rows. Groups 2 and 3
    # start on the last row of a kernel window (of PROMPT_ROWS rows) and run into the next.
    spec = ([(0, 5)] + [(1, 40)] * 3 + [(-1, 0)] * (PROMPT_ROWS - 5) + [(2, 64)] * PROMPT_ROWS + [(3, 64)] * 2
            + [(-1, 0)] * 2)
    groups = torch.tensor([gid for gid, _ in spec])
    prompt = torch.tensor([p for _, p in spec])
    rows = len(spec)
    slots = torch.randperm(rows + 1, generator=g)[:rows]
    kc = torch.randn(rows + 1, K, 160, d, generator=g)
    vc = torch.randn(rows + 1, K, 160, d, generator=g)
    for gid in (1, 2, 3):  # a group's rows hold the same copy of its prompt
        members = slots[groups == gid]
        n = int(prompt[groups == gid][0])
        kc[members, :, :n] = kc[members[:1], :, :n]
        vc[members, :, :n] = vc[members[:1], :, :n]
    lengths = prompt + torch.randint(1, 90, (rows,), generator=g)
    q = torch.randn(rows, H, d, generator=g)
    want = decode_attention_torch(q, kc, vc, slots, lengths, None)
    for splits in (1, 3):
        got = decode_attention_triton(q, kc, vc, slots, lengths, None, (groups, prompt), splits=splits)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"shared prompts, splits {splits}")


def paged_copy(kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, block: int, g: torch.Generator,
               share: dict[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slots of contiguous caches [S,K,M,d] cut into blocks of ``block`` positions, placed in
    shuffled blocks of a pool with spare ones: (k pool, v pool, block rows [B, M / block]).
    ``share`` {row: row it shares with}: a row's leading whole blocks that equal the other's are
    that row's blocks (as a prompt's samples share them)."""
    S, K, M, d = kc.shape
    n = M // block
    total = len(slots) * n + 3
    order = torch.randperm(total, generator=g)
    rows = order[: len(slots) * n].view(len(slots), n).clone()
    for row, other in (share or {}).items():
        same = [(kc[slots[row], :, j * block:(j + 1) * block] == kc[slots[other], :, j * block:(j + 1) * block]).all()
                for j in range(n)]
        lead = next((j for j, eq in enumerate(same) if not eq), n)
        rows[row, :lead] = rows[other, :lead]
    pools = []
    for c in (kc, vc):
        pool = torch.randn(total, K, block, d, generator=g).to(c.dtype)
        for b, slot in enumerate(slots.tolist()):
            for j in range(n):
                if (share or {}).get(b) is None or not (rows[b, j] == rows[share[b], j]):
                    pool[rows[b, j]] = c[slot, :, j * block:(j + 1) * block]
        pools.append(pool)
    return pools[0], pools[1], rows


def check_paged() -> None:
    """Rows whose positions lie in scattered blocks (a paged cache) give the outputs of their
    contiguous slots: blocks of 16 and of 48 positions (tiles of 64 straddle them), of 64 and 128
    (each tile in one block; windows and splits start tiles mid-block), windows, GQA, bf16, several
    splits; and a prompt's samples sharing their prompt's whole blocks, read once."""
    from shardflow.engine.generate.decode_attention import decode_attention_triton

    g = torch.Generator().manual_seed(5)
    for H, K, d, dtype, window, block in ((4, 2, 16, torch.float32, None, 16), (6, 2, 24, torch.float32, 40, 48),
                                         (8, 1, 32, torch.bfloat16, None, 48), (4, 2, 16, torch.float32, None, 64),
                                         (6, 2, 24, torch.float32, 40, 64), (4, 1, 16, torch.float32, 100, 128)):
        lengths = torch.tensor([1, 64, 65, 288, 137, 2, 90, 287])
        slots = torch.tensor([2, 0, 5, 3, 1, 7, 6, 4])
        span = -(-288 // block) * block  # whole blocks
        kc = torch.randn(8, K, span, d, generator=g).to(dtype)
        vc = torch.randn(8, K, span, d, generator=g).to(dtype)
        q = torch.randn(8, H, d, generator=g).to(dtype)
        want = decode_attention_torch(q.float(), kc.float(), vc.float(), slots, lengths, window)
        kp, vp, rows = paged_copy(kc, vc, slots, block, g)
        torch.testing.assert_close(decode_attention_torch(q.float(), kp.float(), vp.float(), rows, lengths, window),
                                   want, atol=1e-5, rtol=0)
        for splits in (1, 3):
            got = decode_attention_triton(q, kp, vp, rows, lengths, window, splits=splits).float()
            atol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=f"paged {H} {K} {d} {dtype} {window} {block}")
    # a prompt of 40 positions shared by rows 0-2 (two whole blocks of 16), of 5 by rows 3-4 (none)
    H, K, d, block = 4, 2, 16, 16
    groups, prompt = torch.tensor([0, 0, 0, 1, 1, -1]), torch.tensor([40, 40, 40, 5, 5, 0])
    slots = torch.arange(6)
    kc, vc = torch.randn(6, K, 96, d, generator=g), torch.randn(6, K, 96, d, generator=g)
    for members, n in (([0, 1, 2], 40), ([3, 4], 5)):
        kc[members, :, :n] = kc[members[:1], :, :n]
        vc[members, :, :n] = vc[members[:1], :, :n]
    lengths = prompt + torch.tensor([30, 9, 56, 1, 20, 70])
    q = torch.randn(6, H, d, generator=g)
    want = decode_attention_torch(q, kc, vc, slots, lengths, None)
    kp, vp, rows = paged_copy(kc, vc, slots, block, g, share={1: 0, 2: 0, 4: 3})
    assert (rows[1:3, :2] == rows[0, :2]).all() and not (rows[1:3, 2] == rows[0, 2]).any()
    for splits in (1, 3):
        got = decode_attention_triton(q, kp, vp, rows, lengths, None, (groups, prompt), splits=splits)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"paged shared prompts, splits {splits}")
    # blocks of 64: a prompt of 70 positions (one whole shared block; the rows' own positions begin
    # mid-block), of 64 (exactly one block)
    block = 64
    groups, prompt = torch.tensor([0, 0, 1, 1, 1, -1]), torch.tensor([70, 70, 64, 64, 64, 0])
    kc, vc = torch.randn(6, K, 192, d, generator=g), torch.randn(6, K, 192, d, generator=g)
    for members, n in (([0, 1], 70), ([2, 3, 4], 64)):
        kc[members, :, :n] = kc[members[:1], :, :n]
        vc[members, :, :n] = vc[members[:1], :, :n]
    lengths = prompt + torch.tensor([30, 100, 1, 64, 65, 150])
    want = decode_attention_torch(q, kc, vc, slots, lengths, None)
    kp, vp, rows = paged_copy(kc, vc, slots, block, g, share={1: 0, 3: 2, 4: 2})
    for splits in (1, 3):
        got = decode_attention_triton(q, kp, vp, rows, lengths, None, (groups, prompt), splits=splits)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"paged blocks of 64, shared prompts, {splits}")


def check_engine(path: str) -> None:
    """Greedy and sampled generation with the Triton kernel equal the torch path's."""
    from gen_helpers import local_model, prompts

    from shardflow.engine.generate.engine import EngineConfig, GenerationEngine
    from shardflow.engine.generate.requests import SamplingParams, make_requests

    model = local_model(path)
    outputs = {}
    for attention in ("torch", "triton"):
        engine = GenerationEngine(model, EngineConfig(max_seq_len=48, attention=attention), eos_token_ids=())
        requests = make_requests(prompts()[2:], [SamplingParams(max_new_tokens=3, temperature=t, seed=1)
                                                 for t in (0.0, 1.0)])
        engine.generate(requests)
        outputs[attention] = requests
    for a, b in zip(outputs["torch"], outputs["triton"]):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-5, rtol=0)


def check_engine_sharing_prompts(path: str) -> None:
    """With ``share_prompt_kv`` the engine's tokens and log-probabilities are the torch path's:
    two prompts of 11 samples each (more than PROMPT_ROWS: two prompt groups per prompt), rows
    leaving after 1-5 tokens (the batch compacts), greedy and sampled; in a contiguous cache and in
    a paged one (where the samples share their prompt's whole blocks)."""
    from dataclasses import replace

    from gen_helpers import local_model, prompts

    from shardflow.engine.generate.engine import EngineConfig, GenerationEngine
    from shardflow.engine.generate.requests import SamplingParams, make_requests

    model = local_model(path)
    outputs = {}
    for attention, block in (("torch", None), ("triton", None), ("triton", 16)):
        engine = GenerationEngine(model, EngineConfig(max_seq_len=48, attention=attention, share_prompt_kv=True,
                                                      kv_block_size=block), eos_token_ids=())
        shared = []  # the longest shared prompt each decode step passed to the attention
        inner = engine.attention
        engine.attention = lambda *args: (shared.append(int(args[6][1].max())), inner(*args))[1]
        requests = make_requests(prompts()[1:3], [SamplingParams(temperature=t, seed=3) for t in (0.0, 1.0)],
                                 samples_per_prompt=11)
        for i, r in enumerate(requests):
            r.params = replace(r.params, max_new_tokens=1 + i % 5)
        engine.generate(requests)
        assert shared and min(shared) > 0
        assert {(r.prompt_group, r.shared_prompt) for r in requests} == {(-1, 0)}  # no KV held any more
        outputs[attention, block] = requests
    for a, b, c in zip(outputs["torch", None], outputs["triton", None], outputs["triton", 16]):
        assert a.output_ids == b.output_ids == c.output_ids
        torch.testing.assert_close(torch.tensor(a.output_logprobs), torch.tensor(c.output_logprobs), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-5, rtol=0)


def test_triton_kernel_matches_torch_in_the_interpreter(checkpoints):
    path = checkpoints.get("mistral_window", "mistral")  # a sliding window in decode too
    plain = checkpoints.get("llama_plain", "llama")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    bg = Background()  # the kernel's checks and the engine's, side by side
    for key, checks in (("kernel", "t.check_kernel(); t.check_shared_prompts(); t.check_paged()"),
                        ("engine", f"t.check_engine({path!r}); t.check_engine_sharing_prompts({plain!r})")):
        bg.start(key, [sys.executable, "-c", f"import test_decode_attention as t; {checks}; print('checked')"],
                 cwd=Path(__file__).parent, env=env, timeout=600)
    try:
        for key in ("kernel", "engine"):
            done = bg.result(key)
            assert done.returncode == 0 and "checked" in done.stdout, (key, done.stderr[-4000:])
    finally:
        bg.close()


def test_torch_path_masks_past_the_length_and_outside_the_window():
    g = torch.Generator().manual_seed(1)
    kc, vc = torch.randn(3, 2, 20, 8, generator=g), torch.randn(3, 2, 20, 8, generator=g)
    q = torch.randn(2, 4, 8, generator=g)
    slots, lengths = torch.tensor([2, 0]), torch.tensor([7, 20])
    for window in (None, 5):
        got = decode_attention_torch(q, kc, vc, slots, lengths, window)
        for b in range(2):
            lo = 0 if window is None else max(0, int(lengths[b]) - window)
            k = kc[slots[b], :, lo: lengths[b]].repeat_interleave(2, 0)  # [H, n, d]
            v = vc[slots[b], :, lo: lengths[b]].repeat_interleave(2, 0)
            w = torch.softmax((q[b, :, None] @ k.transpose(1, 2)) / 8 ** 0.5, -1)  # [H, 1, n]
            torch.testing.assert_close(got[b], (w @ v)[:, 0], atol=1e-6, rtol=0)


def test_kernels_compile_for_hopper(monkeypatch):
    """The interpreter runs the kernels' Python, not their compilation: compile each variant the
    engine launches for sm_90 (Triton's own ptxas, no GPU needed), prompt sharing on and off."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    # CPython 3.11's ast.parse is not safe across threads (a shared recursion-depth count: "AST
    # constructor recursion depth mismatch"); the kernels' sources are parsed one at a time, and
    # the long passes after it still run in parallel.
    parse, lock = getattr(JITFunction, "parse", None), threading.Lock()

    def parse_one_at_a_time(self):
        with lock:
            return parse(self)

    if hasattr(JITFunction, "parse"):
        monkeypatch.setattr(JITFunction, "parse", parse_one_at_a_time)

    from shardflow.engine.generate import decode_attention as da

    pointers = {"Q": "bf16", "K": "bf16", "V": "bf16", "Out": "bf16", "Blocks": "i64", "Lengths": "i64",
                "Groups": "i64", "Prompt": "i64"}

    def compile_for_hopper(fn, constants: dict) -> None:
        types = {n: "constexpr" if n in constants else f"*{pointers.get(n, 'fp32')}" if n[0].isupper()
                 else "fp32" if n == "scale_log2" else "i32" for n in fn.arg_names}
        source = ASTSource(fn=fn, signature=types,
                           constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": da.NUM_WARPS,
                                                                          "num_stages": da.NUM_STAGES})

    knobs = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK=da.BLOCK_N, PRECISION="tf32", UPCAST=False)
    variants = []
    for group in (2, 4):  # Qwen3-1.7B's and LLaMA-3.1-8B's query heads per KV head
        for paged in (False, True):
            for splits, shared in ((1, False), (3, False), (1, True), (3, True)):
                variants.append((da._split_kernel, dict(knobs, GROUP=group, SPLITS=splits, BLOCK_H=16,
                                                        SHARED=shared, PAGED=paged, TILE_IN_BLOCK=paged)))
            variants.append((da._prompt_kernel, dict(knobs, GROUP=group, ROWS=da.PROMPT_ROWS,
                                                     BLOCK_Q=max(16, da.PROMPT_ROWS * group), PAGED=paged,
                                                     TILE_IN_BLOCK=paged)))
    with ThreadPoolExecutor(WORKERS) as pool:  # Triton's passes and ptxas run outside the GIL
        list(pool.map(lambda variant: compile_for_hopper(*variant), variants))
