"""SGLang's process groups and the setup's collective steps over them: the groups a layout finds,
a rank's sidecar socket, the gather of every rank's decision and the MAX vote of an
"unavailable" flag. Everything here runs at setup, never on SGLang's traced path."""
from typing import List, Optional

from .layouts import Layout


def dtype_name(dtype) -> Optional[str]:
    if isinstance(dtype, str):
        return dtype if dtype in ("bf16", "fp16", "fp32") else None
    import arfuse.torch as aft
    return aft.dtype_name(dtype)


def sglang_groups(layout: Optional[Layout]):
    """SGLang's (TP, attention TP, post-experts) group coordinators, as `layout` finds them."""
    from sglang.srt.distributed import parallel_state as ps

    tp, attn = ps.get_tp_group(), ps.get_attn_tp_group()
    if layout is not None and layout.post_experts_group == "reduction_group":
        from sglang.srt.layers.moe.utils import post_experts_reduction_group
        moe = post_experts_reduction_group()
    else:
        ep = ps.get_moe_ep_group()
        moe = ep if ep.world_size > 1 else ps.get_moe_tp_group()
    return tp, attn, moe


def socket_for(template: str, rank: int, device_index: int) -> str:
    import torch.distributed as dist
    glob = dist.get_rank() if dist.is_initialized() else rank
    return template.format(rank=rank, global_rank=glob, gpu=device_index)


def gather(local: Optional[str], group, world: int) -> List[Optional[str]]:
    """Every rank's reason not to serve (None: this rank can), over the TP CPU group."""
    import torch.distributed as dist
    if world <= 1 or not dist.is_initialized():
        return [local]
    out: List[Optional[str]] = [None] * world
    dist.all_gather_object(out, local, group=group)
    return out


def vote_unavailable(local_unavailable: bool, group) -> bool:
    """MAX all-reduce of an "unavailable" flag over `group`: True when any rank is."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) <= 1:
        return local_unavailable
    on_cpu = dist.get_backend(group) != "nccl"
    flag = torch.tensor([1 if local_unavailable else 0], dtype=torch.int32,
                        device="cpu" if on_cpu else torch.device("cuda",
                                                                 torch.cuda.current_device()))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(int(flag.item()))
