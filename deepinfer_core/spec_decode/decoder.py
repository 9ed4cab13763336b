"""The speculative decode step and the draft passes (MTP, EAGLE-style) that feed it.

A decode step of L-token sequence s with drafts d_1..d_k (from its slot) feeds
[t_{L-1}, d_1, .., d_k] at positions L-1 .. L-1+k: one target forward scores all 1 + k positions
(the scheduler reserved `1 + nextn` token slots per sequence). `verify.py` keeps a accepted drafts
plus one target token; only positions L-1 .. L-1+a count as computed, so the KV the rejected drafts
wrote is rolled back by never being counted: the next step writes over it (the blocks the step
reserved are a subset of what the next step reserves). Sequences that cannot draft (penalties,
logprobs, a per-request seed, min_tokens pending, no slot yet) feed their one token and sample with
the ordinary sampler in the same forward.

After every step (`propose`, prefill steps too) the MTP layer runs over the positions the step
computed, with the target's hidden states there and the tokens one place later: this writes the
MTP layer's own KV (one extra paged layer, `CacheEngine.draft_kv_caches`) and its last row drafts
d_1; d_2..d_k chain the layer one position at a time on its own output.

Both run in the shape of decode: one attention row per token (`input_batch.token_row_attention`),
so the Triton decode kernels and, on CUDA, the captured graphs take them (the target's buckets reach
`max_num_seqs * (1 + nextn)` rows; the MTP layer has its own, `cuda_graph.DraftGraphs`). Fed as one
prefill-shaped row per sequence instead, the MLA attention expands every sequence's latent context
in a Python loop, eagerly: 60 ms a step at V3's widths and batch 32 on an H200, against 7 ms now.
Only the draft pass right after a prefill (a whole prompt per sequence) stays per sequence.

Steps with drafts are synchronous: the accepted count is needed before the drafts of the next
step exist, so zero-overhead scheduling is off on a drafting engine. Verification reads the greedy
rows' argmax back once per step, and each draft position once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch

from deepinfer_core.models.layers.attention import AttentionMetadata
from deepinfer_core.sampling.sampler import processed_probs
from deepinfer_core.sampling.sampling_row import SamplingRow
from deepinfer_core.scheduler.outputs import SchedulerOutputs
from deepinfer_core.scheduler.scheduler import Scheduler
from deepinfer_core.sequence import Sequence
from deepinfer_core.spec_decode.slots import DraftSlot, DraftSlots
from deepinfer_core.spec_decode.verify import accept_greedy, accept_sampled
from deepinfer_core.worker.events import to_device
from deepinfer_core.worker.input_batch import build_model_input, token_row_attention
from deepinfer_core.worker.model_runner import StepHandle, StepResult


def can_draft(seq: Sequence) -> bool:
    """Drafts are verified against the plain sampling distribution: not for rows whose sampling
    reads output values (penalties), reports logprobs, draws from a request's own generator, or
    still bans EOS (min_tokens)."""
    p = seq.params
    plain = p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
    return plain and p.logprobs is None and seq.generator is None and len(seq.output_token_ids) >= p.min_tokens


def _row(seq: Sequence) -> SamplingRow:
    return SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, None, seq.eos_token_id)


@dataclass
class _Computed:
    """What a step computed, for the draft pass: hidden rows and the extra accepted positions."""

    out: SchedulerOutputs
    row0: list[int]  # per scheduled seq: its first row in `hidden`
    hidden: torch.Tensor  # [T, H]: the target's last hidden states of the step
    accepted: dict[int, int] = field(default_factory=dict)  # batch index -> drafts accepted


class SpecDecoder:
    def __init__(self, runner, draft, scheduler: Scheduler, nextn: int, max_num_seqs: int):
        self.runner = runner
        self.draft = draft
        self.scheduler = scheduler
        self.nextn = nextn
        self.max_model_len = runner.config.scheduler.max_model_len
        self.slots = DraftSlots(max_num_seqs, nextn)
        scheduler.draft_slots = self.slots  # freed with the sequence's blocks
        self._last: Optional[_Computed] = None

    # ---- the verification step ----------------------------------------------------------
    @torch.inference_mode()
    def launch(self, out: SchedulerOutputs, rows: list[list[SamplingRow]]) -> StepHandle:
        """Target forward over every sequence's last token and drafts, acceptance, samples. Synchronous."""
        runner, seqs = self.runner, out.scheduled_seqs
        runner.apply_copies(out)
        drafts = [self._drafts(seq, out.num_new_tokens[i]) for i, seq in enumerate(seqs)]
        for seq, d in zip(seqs, drafts):
            seq.output_token_ids.extend(d.tokens if d else [])  # fed, not yet outputs
        try:
            counts = [n + (len(d.tokens) if d else 0) for n, d in zip(out.num_new_tokens, drafts)]
            inp = build_model_input(seqs, counts, runner.block_size, runner.device, token_rows=self._short(counts))
        finally:
            for seq, d in zip(seqs, drafts):
                if d:
                    del seq.output_token_ids[-len(d.tokens) :]
        hidden = runner._forward(inp)  # [T, H]
        if runner.device.type == "cuda":  # KV of this step is written once it completes (KV store saves)
            runner.forward_event = torch.cuda.Event()
            runner.forward_event.record()
        row0 = list(itertools.accumulate(counts, initial=0))[:-1]
        logits = runner.model.compute_logits(hidden)  # [T, V]
        result = StepResult([[] for _ in seqs], [[] for _ in seqs], [[] for _ in seqs], consecutive=True)
        computed = _Computed(out, row0, hidden)
        self._sample_plain(out, rows, drafts, logits, row0, counts, result)
        greedy = [i for i, d in enumerate(drafts) if d and seqs[i].params.is_greedy]
        best = self._argmax_rows(logits, {i: (row0[i], counts[i]) for i in greedy})  # one host sync
        for i, d in enumerate(drafts):
            if d:
                if i in best:
                    tokens = accept_greedy(best[i], d.tokens)
                else:
                    tokens = self._verify_sampled(seqs[i], logits[row0[i] : row0[i] + counts[i]], d)
                result.token_ids[i] = tokens
                computed.accepted[i] = len(tokens) - 1
                self.slots.stats.record(len(d.tokens), len(tokens) - 1)
        self._last = computed
        return StepHandle(lambda: result)

    def _drafts(self, seq: Sequence, num_new: int) -> Optional[DraftSlot]:
        """The drafts seq i verifies this step, cut to what its length caps can still emit."""
        slot = self.slots.get(seq)
        if slot is None or not slot.tokens or num_new != 1 or not can_draft(seq):
            return None
        n = min(len(slot.tokens), self.max_model_len - len(seq))  # positions stay under max_model_len
        if seq.params.max_tokens is not None:  # a + 1 tokens come out of a accepted drafts
            n = min(n, seq.params.max_tokens - len(seq.output_token_ids) - 1)
        if n <= 0:
            return None
        return DraftSlot(slot.tokens[:n], slot.probs[:n] if slot.probs is not None else None)

    def _sample_plain(self, out, rows, drafts, logits, row0, counts, result: StepResult) -> None:
        """Sequences without drafts: the ordinary sampler on their one row."""
        plain = [i for i, d in enumerate(drafts) if d is None and rows[i]]
        if not plain:
            return
        index = to_device([row0[i] + counts[i] - 1 for i in plain], torch.long, logits.device)
        sampled = self.runner.sampler(logits.index_select(0, index), [rows[i][0] for i in plain])
        for k, i in enumerate(plain):
            result.token_ids[i] = [sampled.token_ids[k]]
            if sampled.logprobs is not None:
                result.logprobs[i] = [sampled.logprobs[k]]
                result.top_logprobs[i] = [sampled.top_logprobs[k] if sampled.top_logprobs else None]

    def _short(self, counts: list[int]) -> bool:
        """Steps of at most 1 + nextn tokens per sequence run as one attention row per token (the
        decode kernels and graphs; `input_batch.token_row_attention`); longer ones (a chunk of a
        prompt in the step) keep the per-sequence layout."""
        return bool(counts) and max(counts) <= 1 + self.nextn

    @staticmethod
    def _argmax_rows(logits: torch.Tensor, spans: dict[int, tuple[int, int]]) -> dict[int, list[int]]:
        """Per batch index, the target's argmax at its rows [row0, row0 + n): one device-to-host
        copy for the whole step, not one per sequence."""
        if not spans:
            return {}
        best = logits.argmax(dim=-1).tolist()
        return {i: best[r : r + n] for i, (r, n) in spans.items()}

    @staticmethod
    def _verify_sampled(seq: Sequence, logits: torch.Tensor, slot: DraftSlot) -> list[int]:  # logits [k+1, V]
        target = processed_probs(logits.clone(), [_row(seq)] * logits.shape[0])
        return accept_sampled(target, slot.probs, slot.tokens)

    # ---- the draft passes -----------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, out: SchedulerOutputs, live) -> None:
        """After a step's tokens are in: count the accepted positions as computed, run the MTP layer
        over what the step computed, and leave each drafting sequence's next drafts in its slot.
        `live`: request ids still in the engine."""
        step = self._last if self._last is not None and self._last.out is out else self._from_prefill(out)
        self._last = None
        picked = []
        for i, seq in enumerate(out.scheduled_seqs):
            if seq.request_id not in live or seq.is_finished:
                continue
            a = step.accepted.get(i, 0)
            if a:
                seq.num_cached_tokens += a
                self.scheduler.commit_computed(seq)
            n, c = out.num_new_tokens[i] + a, seq.num_cached_tokens
            if len(seq) >= c + 1:  # the token after each computed position is known
                picked.append((i, seq, c - n, n))
        if picked:
            self._draft_pass(step, picked)

    def _from_prefill(self, out: SchedulerOutputs) -> _Computed:
        counts = self.runner.last_input.attn_meta.query_lens_cpu
        hidden, self.runner.last_hidden = self.runner.last_hidden, None  # not kept past the step
        return _Computed(out, list(itertools.accumulate(counts, initial=0))[:-1], hidden)

    @torch.inference_mode()
    def start_from_handoff(self, seq: Sequence, last_hidden: torch.Tensor) -> None:
        """A handed-off sequence (prompt KV from a PE, first token sampled there): draft from the
        prompt's last hidden state (`handoff.py`). The draft cache of its private blocks is zeroed
        first, as the PE computed no MTP KV for the prompt."""
        bm = self.scheduler.block_manager
        private = [b for b in seq.block_table if bm.ref_counts[b] == 1]
        if private:
            self.runner.cache.draft_kv_buffer[:, to_device(private, torch.long, self.runner.device)] = 0
        c = seq.num_cached_tokens
        self._draft_pass(_Computed(None, [0], last_hidden[None]), [(0, seq, c - 1, 1)])

    def _draft_pass(self, step: _Computed, picked: list[tuple[int, Sequence, int, int]]) -> None:
        seqs = [p[1] for p in picked]
        starts, counts = [p[2] for p in picked], [p[3] for p in picked]
        rows = [r for i, _, _, n in picked for r in range(step.row0[i], step.row0[i] + n)]
        prev = step.hidden.index_select(0, to_device(rows, torch.long, step.hidden.device))
        tokens = [t for seq, s, n in zip(seqs, starts, counts) for t in seq.token_slice(s + 1, s + n + 1)]
        x = self._run(seqs, starts, counts, tokens, prev)  # [T, H]
        last = list(itertools.accumulate(counts))
        drafting = [k for k, seq in enumerate(seqs) if len(seq) == starts[k] + counts[k] + 1 and can_draft(seq)]
        slots = {k: self.slots.assign(seqs[k]) for k in drafting}
        drafting = [k for k in drafting if slots[k] is not None]
        for k in drafting:
            slots[k].tokens, slots[k].probs = [], None
        h = x[[last[k] - 1 for k in drafting]] if drafting else None
        for j in range(self.nextn):
            if not drafting:
                return
            if j > 0:  # chain: position c + j - 1 (c = len - 1) takes draft j and the layer's own output
                keep = [r for r, k in enumerate(drafting) if self._room(seqs[k], j)]
                drafting, h = [drafting[r] for r in keep], h[keep]
                if not drafting:
                    return
                pos = [len(seqs[k]) - 1 + j - 1 for k in drafting]
                toks = [slots[k].tokens[-1] for k in drafting]
                h = self._run([seqs[k] for k in drafting], pos, [1] * len(drafting), toks, h)
            self._take_drafts([seqs[k] for k in drafting], [slots[k] for k in drafting], h)

    def _room(self, seq: Sequence, j: int) -> bool:
        """Blocks for the chained position len(seq) - 1 + j (the next step reserves them anyway)."""
        bm = self.scheduler.block_manager
        if len(seq) - 1 + j >= self.max_model_len or not bm.can_append_slot(seq, j):
            return False
        bm.append_slots(seq, j)
        return True

    def _take_drafts(self, seqs: list[Sequence], slots, h: torch.Tensor) -> None:
        """One more draft per sequence from the layer's output rows `h` [n, H]."""
        logits = self.draft.compute_logits(h)  # [n, V]
        greedy = logits.argmax(dim=-1).tolist()
        for k, (seq, slot) in enumerate(zip(seqs, slots)):
            if seq.params.is_greedy:
                slot.tokens.append(greedy[k])
                continue
            q = processed_probs(logits[k : k + 1].clone(), [_row(seq)])  # [1, V]
            slot.tokens.append(int(torch.multinomial(q[0], 1).item()))
            slot.probs = q if slot.probs is None else torch.cat([slot.probs, q])

    def _run(self, seqs, starts, counts, tokens, prev_hidden) -> torch.Tensor:
        """The MTP layer over positions [start, start + count) of each sequence: as one attention
        row per position (captured graphs on CUDA) after a decode step, per sequence after a prefill."""
        device, rows = self.runner.device, self._short(counts)
        meta, positions = draft_metadata(seqs, starts, counts, self.runner.block_size, device, rows)
        ids = to_device(tokens, torch.long, device)
        graphs = self.runner.draft_graphs
        if graphs is not None and graphs.can_run_rows(len(tokens), meta):
            return graphs.run_draft(ids, positions, prev_hidden, meta)
        return self.draft(ids, positions, prev_hidden, self.runner.cache.draft_kv_caches[0], meta)


def draft_metadata(
    seqs: list[Sequence],
    starts: list[int],
    counts: list[int],
    block_size: int,
    device: torch.device,
    token_rows: bool = False,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Attention metadata (and positions [T]) for positions [start, start + count) of each sequence;
    `token_rows`: one attention row per position (`input_batch.token_row_attention`)."""
    slots, positions = [], []
    for seq, s, n in zip(seqs, starts, counts):
        positions += range(s, s + n)
        slots += [seq.block_table[p // block_size] * block_size + p % block_size for p in range(s, s + n)]
    if token_rows:
        return token_row_attention(seqs, starts, counts, slots, device), to_device(positions, torch.long, device)
    width = max(len(s.block_table) for s in seqs)
    table = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
    seq_lens = [s + n for s, n in zip(starts, counts)]
    meta = AttentionMetadata(
        slot_mapping=to_device(slots, torch.int64, device),
        block_tables=to_device(table, torch.int32, device),
        query_start_loc=to_device(list(itertools.accumulate(counts, initial=0)), torch.int32, device),
        seq_lens=to_device(seq_lens, torch.int32, device),
        query_lens_cpu=list(counts),
        seq_lens_cpu=seq_lens,
        is_decode_only=all(n == 1 for n in counts),
    )
    return meta, to_device(positions, torch.long, device)
