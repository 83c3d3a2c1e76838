"""MoE routing replay (the paper's R3) through Megatron-Core's `RouterReplay`, and expert-site
guidance matched by expert id.

    sample.routed_experts [T, layers, top_k] (the rollout's top-k ids, guidance/routing.py)
      ─► per micro-batch and MoE layer: ids [S*B, top_k] in Megatron's token order (s * B + b)
      ─► replay on : each router's RouterReplay gets them with REPLAY_FORWARD: the router's
                     probabilities are its own scores gathered at the rollout's experts (softmax
                     over those k logits when top-k is renormalized), so the gradient still reaches
                     the router; under activation recompute the actor re-sets the micro-batch's ids
                     before its backward (actor.RestoreForBackward), so the recomputed forward
                     routes as the forward did
         replay off: the trainer routes on its own; the ids still name the rollout's slots
      ─► a forward hook on each router counts, over the rollout's (token, layer, k) choices, how
         often the trainer's own top-k (its scores, Megatron's topk) holds the same expert
         (`mismatch/routing_agreement`: below 1 wherever FP4 moved a near-tie, replay or not) and
         how often the routing its forward USED does (`mismatch/routing_replayed`: 1 under replay,
         measured from the router's routing map, not assumed; = the agreement without replay)
Expert-site guidance (`expert_rows`): the allgather dispatcher hands local expert i the tokens of
the TP x EP group's gathered batch where its routing map is set, in increasing token order; the
gate_up input record is per token (every expert quantizes a token's input the same way under
per-token scaling) and the down_proj input record is per (token, slot), the slot being where the
rollout's ids name this expert's GLOBAL id. A token the rollout did not send to this expert has no
down_proj record: its row is round-to-nearest, and routing agreement below 100% says how many.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from megatron_trace.fp4 import RolloutRounding

ROUTING_REPLAY_MODES = ("auto", "on", "off")  # trainer.routing_replay
_ROUTER = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.router$")


def replay_enabled(mode: str, arch) -> bool:
    """trainer.routing_replay: auto (on for MoE models), on (an MoE model is required), off."""
    if mode not in ROUTING_REPLAY_MODES:
        raise ValueError(f"trainer.routing_replay must be one of {', '.join(ROUTING_REPLAY_MODES)}; got {mode!r}")
    if mode == "on" and not arch.is_moe:
        raise ValueError(
            f"trainer.routing_replay=on needs an MoE model; {arch.family} has no routers (use auto or off)"
        )
    return arch.is_moe and mode != "off"


class RoutingReplay:
    """The routers of one model chunk, the current micro-batch's rollout ids, agreement counters."""

    recomputing = False  # set while a checkpointed forward is recomputed: route the same, count once

    def __init__(self, model: torch.nn.Module, arch, layer_offset: int, replay: bool):
        self.arch = arch
        self.routers: dict[int, torch.nn.Module] = {}
        for name, module in model.named_modules():
            m = _ROUTER.match(name)
            if m:
                self.routers[layer_offset + int(m.group(1))] = module
        for layer, router in self.routers.items():
            router.register_forward_hook(self._agreement_hook(layer))
        self.set_replay(replay)
        self.current: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # [S*B] rows
        self.local: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # this rank's router rows
        # Sequence parallelism: each TP rank routes its [S/TP, B] slice of the tokens
        sp = any(r.config.sequence_parallel for r in self.routers.values())
        self.sp_split = _tp_rank_size() if sp else (0, 1)
        # rollout choices the trainer's own router also makes, those its forward used, compared
        self.counts = torch.zeros(3, dtype=torch.float64)

    def set_replay(self, on: bool) -> None:
        """Replay on or off from the next micro-batch (the probe compares both on one model)."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        if on and not self.routers:
            raise ValueError("routing replay needs an MoE model: this one has no routers")
        self.replay = on
        for router in self.routers.values():
            if on and router.router_replay is None:
                # What TransformerConfig.moe_enable_routing_replay makes TopKRouter.__init__ do, here so
                # one model build serves replay on and off (the router reads it at every routing call).
                router.router_replay = RouterReplay()

    # -- per micro-batch -------------------------------------------------------------------------
    def begin(self, routed: list[torch.Tensor | None], names: list[str], placements: list, n_rows: int) -> None:
        """The micro-batch's rollout ids: routed[i] / names[i] of the sample at placements[i]
        (`batching.Placement`: its rows of the micro-batch's n_rows and their positions). With replay
        on every sample must carry them; padding rows replay expert ids 0..k-1 and are not counted."""
        self.current = self.local = None
        if not self.routers:
            return
        missing = [n for n, r in zip(names, routed) if r is None]
        if self.replay and missing:
            raise ValueError(
                f"trainer.routing_replay is on but samples {missing[:3]} carry no routed experts: the rollout "
                "must return them (GenerateRequest.return_routed_experts; a real SGLang server needs "
                "--enable-return-routed-experts)"
            )
        if all(r is None for r in routed):
            if self.replay:
                self._set(None)
            return
        k, layers = self.arch.num_experts_per_tok, self.arch.num_layers
        ids = torch.arange(k).repeat(n_rows, layers, 1)  # [rows, L, k]; padding rows
        valid = torch.zeros(n_rows, dtype=torch.bool)
        for r, name, place in zip(routed, names, placements):
            if r is None:
                continue
            if r.dim() != 3 or r.shape[1:] != (layers, k):
                raise ValueError(
                    f"sample {name}: routed experts of shape {tuple(r.shape)}; "
                    f"need [positions, {layers} layers, top-{k}]"
                )
            held = place.positions < r.shape[0]
            ids[place.rows[held]] = r[place.positions[held]].long()
            valid[place.rows[held]] = True
        self.current = {layer: (ids[:, layer].contiguous(), valid) for layer in self.routers}
        rank, size = self.sp_split
        if n_rows % size:
            raise ValueError(
                f"sequence parallel over {size} ranks needs the micro-batch's {n_rows} rows to be a "
                "multiple of it (the actor pads)"
            )
        rows = slice(rank * n_rows // size, (rank + 1) * n_rows // size)
        self.local = {layer: (ids_[rows], v[rows]) for layer, (ids_, v) in self.current.items()}
        if self.replay:
            self._set(self.local)

    def _set(self, current) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for layer, router in self.routers.items():
            rr = router.router_replay
            rr.clear_indices()
            if current is None:
                rr.clear_router_replay_action()
                continue
            rr.set_target_indices(current[layer][0])
            rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def end(self) -> None:
        self.current = self.local = None
        for router in self.routers.values():
            if router.router_replay is not None:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()

    def rollout_ids(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids [S*B, top_k] int64 in the rollout's top-k order, valid rows [S*B]) of this micro-batch."""
        return None if self.current is None else self.current.get(layer)

    # -- agreement -------------------------------------------------------------------------------
    def _agreement_hook(self, layer: int):
        def hook(router, args, output):
            got = None if self.local is None else self.local.get(layer)
            if got is None or self.recomputing:
                return
            _probs, routing_map = output
            with torch.no_grad():
                ids, valid = got[0].to(routing_map.device), got[1].to(routing_map.device)
                logits = router.gating(args[0]).reshape(-1, router.config.num_moe_experts)
                # Megatron's own choice: top-k of the logits (or of their softmax: the same order)
                own = torch.topk(logits.float(), router.topk, dim=-1).indices
                same = (ids[:, :, None] == own[:, None, :]).any(-1)[valid]
                used = routing_map.gather(1, ids)[valid]
            self.counts += torch.tensor(
                [float(same.sum()), float(used.sum()), float(same.numel())], dtype=torch.float64
            )

        return hook

    def agreement(self, pp_group=None) -> dict[str, float]:
        """{"routing_agreement": share of the rollout's (token, layer, k) choices the trainer's own
        router also made, "routing_replayed": share its forward used}, over every pipeline stage's
        layers (collective over `pp_group` when given, and over TP under sequence parallelism); empty
        if nothing was counted."""
        c = self.counts.clone()
        if pp_group is not None and dist.is_initialized() and dist.get_world_size(pp_group) > 1:
            dist.all_reduce(c, group=pp_group)
        if self.sp_split[1] > 1:  # sequence parallel: each TP rank counted its own tokens
            from megatron.core import parallel_state as ps

            dist.all_reduce(c, group=ps.get_tensor_model_parallel_group())
        if c[2] == 0:
            return {}
        return {"routing_agreement": float(c[0] / c[2]), "routing_replayed": float(c[1] / c[2])}

    def clear_counters(self) -> None:
        self.counts.zero_()


def _tp_rank_size() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def assert_same_micro_batch(ids: torch.Tensor, group) -> None:
    """Expert guidance maps the dispatcher's gathered rows to this rank's rows (row % S*B): every
    rank of the expert-parallel group must hold the same micro-batch (the actor feeds all ranks the
    same samples). Refuse loudly if that ever stops holding."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    parts = [torch.empty_like(ids) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, ids.contiguous(), group=group)
    if not all(torch.equal(p, parts[0]) for p in parts):
        raise RuntimeError(
            "expert-parallel ranks hold different micro-batches: expert-site guidance cannot map "
            "the dispatcher's gathered tokens to the rollout's records"
        )


class ExpertRows:
    """`select` for local expert `local_expert` of `moe_layer`: its rows of a site's [S*B, ...]
    guidance, matched by the expert's global id; None (the site's rows use rtn, counted by the QAT
    state) where the rows cannot be mapped: a dispatcher other than allgather, or a per-slot record
    without the rollout's routed experts to name its slot. A record is per (token, slot) for
    down_proj always and for gate_up under static input scales (one per expert); else per token.

    Megatron scales the expert's activation by its routing weight BEFORE linear_fc2 (the engine,
    like HF, after it). MXFP4's power-of-two block scales and a static S_enc cannot absorb that, so
    the QAT state quantizes the linear_fc2 input divided by `input_weights()` (the rows the engine
    quantizes) and scales back; `expert_site` names the expert's own static scale."""

    def __init__(self, state, moe_layer: torch.nn.Module, layer: int, local_expert: int, weighted: bool):
        self.state, self.moe_layer, self.layer, self.local_expert = state, moe_layer, layer, local_expert
        self.weighted = weighted  # linear_fc2: its input carries the routing weight
        self.global_expert = int(moe_layer.local_expert_indices[local_expert])

    def expert_site(self, site: str) -> str:
        """model.layers.L.mlp.experts.gate_up_proj -> model.layers.L.mlp.experts.E.gate_up_proj
        (the key of this expert's static activation scale, transfer.static_scales.static_site_scales)."""
        return site.replace(".mlp.experts.", f".mlp.experts.{self.global_expert}.", 1)

    def _rows_of_expert(self) -> tuple[torch.Tensor, int] | None:
        """(the dispatcher's gathered token indices of this expert, where its weights start in
        local_probs), or None without the allgather dispatcher's routing map."""
        d = self.moe_layer.token_dispatcher
        local_map = getattr(d, "local_map", None)
        if local_map is None:
            return None
        return local_map[:, self.local_expert].nonzero().squeeze(-1), int(local_map[:, : self.local_expert].sum())

    def input_weights(self) -> torch.Tensor | None:
        """fp32 [n_e] routing weight of each of this expert's rows, multiplied into linear_fc2's
        input by Megatron (None for linear_fc1, whose input is unweighted)."""
        if not self.weighted:
            return None
        got = self._rows_of_expert()
        if got is None:
            raise ValueError(
                f"layer {self.layer} expert {self.global_expert}: the down_proj input needs the "
                "routing weights Megatron applied before linear_fc2, which only the allgather "
                "token dispatcher exposes (trainer: moe_token_dispatcher_type=allgather)"
            )
        tokens, start = got
        return self.moe_layer.token_dispatcher.local_probs.detach()[start : start + len(tokens)].float()

    def __call__(self, rr: RolloutRounding, mask: torch.Tensor):
        got = self._rows_of_expert()
        n = mask.numel()
        if got is None or self.moe_layer.token_dispatcher.local_map.shape[0] % n:
            return None
        rows = got[0] % n  # the gathered batch is the TP x EP group's copies of this micro-batch
        sel = RolloutRounding(*(_index(t, rows) for t in (rr.scale, rr.global_scale, rr.codes, rr.mantissa)))
        keep = mask[rows]
        if sel.scale.dim() == 2:  # [n_e, blocks]: a per-token record
            return sel, keep
        replay = getattr(self.state, "routing_replay", None)
        routed = replay.rollout_ids(self.layer) if replay is not None else None
        if routed is None:
            return None
        ids, valid = routed
        hit = ids.to(rows.device)[rows] == self.global_expert  # [n_e, top_k]
        keep = keep & hit.any(-1) & valid.to(rows.device)[rows]
        at = (torch.arange(len(rows)), hit.to(torch.int8).argmax(-1))  # each row's slot
        picked = (_index(t, at) for t in (sel.scale, sel.global_scale, sel.codes, sel.mantissa))
        return RolloutRounding(*picked), keep


def _index(t: torch.Tensor | None, idx) -> torch.Tensor | None:
    """t[idx] for a guidance tensor that may be absent (codes or mantissa bits)."""
    return None if t is None else t[idx]


def expert_rows(state, moe_layer: torch.nn.Module, layer: int, local_expert: int, per_slot: bool) -> ExpertRows:
    """The `select` of one local expert's linear_fc1 or (per_slot, its input weighted) linear_fc2."""
    return ExpertRows(state, moe_layer, layer, local_expert, per_slot)
