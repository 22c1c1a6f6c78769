"""tp_decode's planes (no torch): what runs where after negotiation (decide_execution), the
eager plane's plans, the doorbell plane's plans and rings, the in-stream plane's attach, the
loud eager-decode check, and the setup-only rank (every site's fused op on known data, checked
against a CPU reference, without torch).
"""
import dataclasses
from typing import List, Optional

from tpd_common import PROG, ModelConfig, PoolLayout, SetupError, log, site_name


PLANE_TEXT = {"instream": "in-stream plane (the sidecar's kernel launched in this process's "
                         "stream: arfuse.torch)",
              "doorbell": "doorbell plane (ring kernel)",
              "eager": "eager plane (one Fusion.Execute RPC per op)",
              "framework": "framework path (torch.distributed + RMSNorm)"}


@dataclasses.dataclass
class ExecPlan:
    """How this rank runs the per-layer op, after negotiation (same on every rank)."""
    fused: bool                 # through the sidecar at all
    prefill_plane: str          # "instream", "eager" (allreduce_fusion) or "framework"
    decode_graph: str           # "none", "piecewise" or "full"
    decode_plane: str           # "instream", "doorbell", "eager" or "framework"
    op_in_graph: bool           # the per-layer op is captured in the decode graph(s)
    notes: List[str] = dataclasses.field(default_factory=list)

    @property
    def eager_decode(self) -> bool:
        """Decode's fused ops go over the eager plane: an RPC per op, never what a real model
        should silently end up on (eager_decode_check)."""
        return self.fused and self.decode_plane == "eager"

    def describe(self) -> str:
        where = "inside the graph" if self.op_in_graph else (
            "between graph pieces" if self.decode_graph != "none" else "eagerly")
        graph = {"none": "no CUDA graph", "piecewise": "piecewise CUDA graphs",
                 "full": "one full CUDA graph"}[self.decode_graph]
        pre = {"instream": "in-stream plane (arfuse.torch op)",
               "eager": "eager plane (allreduce_fusion)"}.get(self.prefill_plane,
                                                              "framework path")
        s = (f"prefill: {pre}; decode: {graph}, per-layer op on the "
             f"{PLANE_TEXT[self.decode_plane]} {where}")
        return s + "".join(f"\n    note: {n}" for n in self.notes)


def decide_execution(neg, device: str, want_mode: str, framework_capturable: bool,
                     doorbell_ok: Optional[bool] = None, doorbell_reason: str = "",
                     instream_ok: Optional[bool] = None, instream_reason: str = "") -> ExecPlan:
    """Honours the negotiation: the graph mode it allows and the data plane it names.

    neg: arfuse.Negotiation (group decision). framework_capturable: the framework's own
    collective can sit in a CUDA graph (NCCL; gloo cannot). doorbell_ok / instream_ok: whether
    every rank got its doorbell plans and rings / its in-stream attachment (None: not tried)."""
    notes = []
    allowed = neg.cuda_graph_mode if device == "cuda" else "none"
    if not neg.fusion_enabled:
        why = "; ".join(neg.reasons) or f"backend {neg.backend}"
        if device != "cuda":
            return ExecPlan(False, "framework", "none", "framework", False,
                            [f"fusion off ({why}): framework path"])
        notes.append(f"fusion off ({why}): the framework path runs every op")
        if allowed == "none":
            return ExecPlan(False, "framework", "none", "framework", False, notes)
        if framework_capturable:
            return ExecPlan(False, "framework", allowed, "framework", True, notes)
        notes.append("the framework collective (gloo) cannot be captured: it runs between "
                     "graph pieces")
        return ExecPlan(False, "framework", "piecewise", "framework", False, notes)
    if neg.data_plane == "instream":
        if instream_ok:
            if device != "cuda":
                return ExecPlan(True, "instream", "none", "instream", False,
                                ["cpu: host-mode sidecars (the CPU implementation behind the "
                                 "same C ABI), no CUDA graphs"])
            if allowed == "none" and want_mode != "none":
                notes.append(f"negotiation allows no CUDA graphs (asked for {want_mode})")
            return ExecPlan(True, "instream", allowed, "instream", allowed != "none", notes)
        notes.append("in-stream plane negotiated but not attached on every rank (" +
                     (instream_reason or "not tried") + "): the fused op falls to the eager "
                     "plane")
    if device != "cuda":
        return ExecPlan(True, "eager", "none", "eager", False,
                        notes + ["cpu: host-mode sidecars, no CUDA graphs"])
    if allowed == "none":
        if want_mode != "none":
            notes.append(f"negotiation allows no CUDA graphs (asked for {want_mode})")
        return ExecPlan(True, "eager", "none", "eager", False, notes)
    if neg.data_plane == "doorbell":
        if doorbell_ok:
            return ExecPlan(True, "eager", allowed, "doorbell", True, notes)
        notes.append("doorbell plane negotiated but unavailable (" +
                     (doorbell_reason or "not set up") +
                     "): the fused op runs on the eager plane between graph pieces")
        return ExecPlan(True, "eager", "piecewise", "eager", False, notes)
    # Eager plane with graphs: a split op between graph pieces (never inside a graph).
    if allowed == "full":
        notes.append("eager plane: the full graph is split into pieces around the fused op")
    return ExecPlan(True, "eager", "piecewise", "eager", False, notes)


EAGER_BANNER = "!!! DECODE ON THE EAGER PLANE: one Fusion.Execute RPC per fused op !!!"


def eager_decode_check(ex: ExecPlan, allowed: bool) -> Optional[dict]:
    """The check a decode on the eager plane gets: never silent, failed unless allowed
    (--allow-eager-decode, or --plane eager asked for it). None when decode is elsewhere."""
    if not ex.eager_decode:
        return None
    why = "; ".join(ex.notes) or "negotiated"
    msg = (f"{EAGER_BANNER} ({why}); " +
           ("allowed by --allow-eager-decode / --plane eager" if allowed else
            "a real model's decode must not end up here: pass --allow-eager-decode to accept it"))
    return {"name": "decode plane", "ok": bool(allowed), "message": msg}


def report_eager_decode(ex: ExecPlan, allowed: bool, rank: int) -> List[dict]:
    """eager_decode_check, logged loudly (to stderr when it fails): [] or [the check]."""
    check = eager_decode_check(ex, allowed)
    if check is None:
        return []
    log(check["message"], rank, err=not check["ok"])
    return [check]


def site_opspec(cfg: ModelConfig, layout: PoolLayout, region, site: int, max_tokens: int):
    import arfuse

    def at(off):
        return arfuse.TensorLoc(region, off)

    return arfuse.OpSpec(pattern="allreduce_residual_rmsnorm", dtype=cfg.dtype,
                         hidden=cfg.hidden, max_tokens=max_tokens, eps=cfg.eps,
                         input=at(layout.offset("partial")),
                         residual_in=at(layout.offset("residual")),
                         residual_out=at(layout.offset("residual")),
                         norm_out=at(layout.offset("h")),
                         gamma=at(layout.gamma_offset(site + 1)))


def create_site_plans(client, cfg: ModelConfig, layout: PoolLayout, region, max_tokens: int,
                      doorbell: bool) -> list:
    """One plan per fused op of the forward (2 per layer), all over the same static tensors
    except the norm weight. On any failure the plans made so far are destroyed."""
    plans = []
    try:
        for site in range(cfg.sites):
            plan = client.create_plan(site_opspec(cfg, layout, region, site, max_tokens),
                                      doorbell=doorbell)
            plans.append(plan)
            if doorbell and plan.doorbell is None:
                raise SetupError("the sidecar made the plan but returned no doorbell")
    except BaseException:
        destroy_plans(client, plans)
        raise
    return plans


def destroy_plans(client, plans):
    for plan in plans:
        try:
            client.destroy_plan(plan)
        except Exception:
            pass


def try_doorbell(client, cfg: ModelConfig, layout: PoolLayout, region, ring_lib: Optional[str]):
    """Doorbell plans for the decode batch and their opened rings. Returns (plans, rings, None)
    or ([], [], reason) without raising: a missing doorbell plane is a fallback, not an error."""
    import arfuse
    from arfuse import ring as ringmod

    plans, rings = [], []
    try:
        lib = ringmod.load_library(ring_lib)
    except OSError as e:
        return [], [], f"libarfuse_ring.so did not load ({e}); set --ring-lib or ARFUSE_RING_LIB"
    try:
        plans = create_site_plans(client, cfg, layout, region, cfg.batch, doorbell=True)
        for i, plan in enumerate(plans):
            rings.append(ringmod.DoorbellRing.open(plan.doorbell, lib=lib, name=f"site{i}"))
        return plans, rings, None
    except (arfuse.ArfuseError, ringmod.RingError, SetupError) as e:
        if isinstance(e, arfuse.SidecarLost):
            raise
        for r in rings:
            try:
                r.close()
            except Exception:
                pass
        destroy_plans(client, plans)
        return [], [], f"{type(e).__name__}: {e}"



def try_instream(client, hiddens: List[int], client_lib: Optional[str] = None):
    """The in-stream plane's attachment (arfuse.instream). Returns (ctx, None) or (None, reason)
    without raising: a plane that cannot attach is a fallback, not an error; a sidecar that is
    gone is an error."""
    import arfuse

    try:
        return client.attach(hiddens, lib=client_lib), None
    except arfuse.SidecarLost:
        raise
    except arfuse.ArfuseError as e:
        return None, f"{type(e).__name__}: {e}"


# =============================================================================================
# Setup-only rank (no torch): negotiation, the plane, every site's fused op on known data
# =============================================================================================

def np_f32_to_bf16(a):
    """float32 -> bf16 bits (uint16), rounding to nearest even."""
    import numpy as np

    b = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >>
            np.uint32(16)).astype(np.uint16)


def np_bf16_to_f32(u):
    import numpy as np

    return (np.asarray(u, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def setup_values(cfg: ModelConfig, world: int, rank: int, site: int, n: int):
    """Inputs exact in bf16: every rank's input (multiples of 1/8 in [-1, 1]), the residual
    (multiples of 1/4) and the site's gamma, as float32 arrays [n, H], [n, H], [H]; plus the
    sum of every rank's input (what the allreduce gives)."""
    import numpy as np

    H = cfg.hidden
    i = np.arange(n * H, dtype=np.int64).reshape(n, H)

    def x(r):
        return (((i * 7 + r * 13 + site * 5) % 17) - 8).astype(np.float32) / 8.0

    residual = ((i % 5) - 2).astype(np.float32) / 4.0
    k = np.arange(H, dtype=np.int64)
    gamma = (0.5 + ((k + site) % 9) / 8.0).astype(np.float32)
    total = sum(x(r) for r in range(world))
    return x(rank), residual, gamma, total


def _encode(a, dtype: str):
    return np_f32_to_bf16(a) if dtype == "bf16" else a.astype("float32")


def _decode(a, dtype: str):
    return np_bf16_to_f32(a) if dtype == "bf16" else a.astype("float32")


def check_setup_values(cfg: ModelConfig, site: int, total, residual_in, gamma, res_out,
                       norm_out) -> int:
    """residual_out must equal the exact sum; norm_out the reference within the dtype's
    tolerance. Returns the number of values checked; raises SetupError naming the first bad
    one."""
    import numpy as np

    dt = cfg.dtype
    want_r = total + residual_in
    got_r = _decode(res_out, dt)
    bad = np.argwhere(got_r != want_r)
    if bad.size:
        t, k = bad[0]
        raise SetupError(f"{site_name(cfg, site)}: residual_out[{t},{k}] = {got_r[t, k]}, "
                         f"expected {want_r[t, k]}")
    inv = 1.0 / np.sqrt((want_r.astype(np.float64) ** 2).mean(-1, keepdims=True) + cfg.eps)
    want_n = want_r * inv * _decode(_encode(gamma, dt), dt)
    got_n = _decode(norm_out, dt)
    tol = 2.0 ** -6 if dt == "bf16" else 1e-5
    bad = np.argwhere(np.abs(got_n - want_n) > tol * np.maximum(1.0, np.abs(want_n)))
    if bad.size:
        t, k = bad[0]
        raise SetupError(f"{site_name(cfg, site)}: norm_out[{t},{k}] = {got_n[t, k]}, "
                         f"expected {want_n[t, k]}")
    return 2 * want_r.size


def _aligned(shape, np_dtype, align: int = 256):
    """A zeroed numpy array whose data starts on an `align`-byte boundary (the op needs 16)."""
    import numpy as np

    nbytes = int(np.prod(shape)) * np.dtype(np_dtype).itemsize
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes].view(np_dtype).reshape(shape)


def run_setup_only(ctx) -> dict:
    """ctx: the rank's RankContext. Negotiation -> the plane -> every site's fused op at every
    step (values checked at step 0 in host mode). Returns the result dict; raises on failure."""
    import arfuse

    cfg, layout, rank, world = ctx.cfg, ctx.layout, ctx.rank, ctx.world
    client, neg = ctx.client, ctx.neg
    result = {"plane": None, "plans": 0, "attached": 0, "sites": cfg.sites, "sites_fused": 0,
              "ops": 0, "checked_values": 0, "checks": []}
    if cfg.dtype not in ("bf16", "fp32"):
        raise SetupError("--setup-only checks values for bf16 and fp32 only")
    buf = ws = region = None
    instream_ctx, instream_reason = None, ""
    doorbell_ok, doorbell_reason = None, ""
    if neg.fusion_enabled and neg.data_plane == "instream":
        instream_ctx, instream_reason = try_instream(client, [cfg.hidden], ctx.client_lib)
        if instream_ctx is not None:
            ctx.instream = instream_ctx
            result["attached"] = 1
            log(f"attached: {instream_ctx!r} (memory {instream_ctx.info.memory_kind or '?'})",
                rank)
        else:
            log(f"in-stream attach failed: {instream_reason}", rank)
    if instream_ctx is None:
        buf = arfuse.CudaBuffer(layout.total, ctx.gpu) if ctx.device == "cuda" else \
            arfuse.HostShmBuffer(layout.total)
        ctx.buffers.append(buf)
        ws = arfuse.FusionWorkspace(client)
        region = ws.register(buf, f"{PROG}-pool")
        if neg.fusion_enabled and neg.data_plane == "doorbell" and ctx.device == "cuda":
            plans, rings, doorbell_reason = try_doorbell(client, cfg, layout, region,
                                                         ctx.ring_lib)
            doorbell_ok = doorbell_reason is None
            for r in rings:
                r.close()
            destroy_plans(client, plans)
    ex = decide_execution(neg, ctx.device, ctx.want_mode, framework_capturable=False,
                          doorbell_ok=doorbell_ok, doorbell_reason=doorbell_reason or "",
                          instream_ok=instream_ctx is not None if neg.data_plane == "instream"
                          else None, instream_reason=instream_reason)
    ctx.report_execution(ex)
    result["plane"] = ex.decode_plane
    result["checks"] += report_eager_decode(ex, ctx.allow_eager_decode, rank)
    if instream_ctx is not None:
        return _setup_instream(ctx, instream_ctx, ex, result)
    # Every fused op of the forward as a plan: the sidecar validates each one's tensors once.
    plans = create_site_plans(client, cfg, layout, region, cfg.max_tokens, doorbell=False)
    result["plans"] = len(plans)
    log(f"{len(plans)} plans validated, one per site (path: {plans[0].reason})", rank)
    destroy_plans(client, plans)
    if not ex.fused:
        log("fusion off: the framework path would run every op (needs torch; not exercised in "
            "--setup-only)", rank)
        return result
    if ctx.device == "cuda":
        log("cuda --setup-only stops here (filling device memory needs torch)", rank)
        return result
    import numpy as np

    H, n, dt = cfg.hidden, cfg.batch, cfg.dtype
    npt = np.uint16 if dt == "bf16" else np.float32
    x = buf.array(npt, (n, H), layout.offset("partial"))
    res = buf.array(npt, (n, H), layout.offset("residual"))
    y = buf.array(npt, (n, H), layout.offset("h"))
    try:
        for step in range(cfg.steps):
            _maybe_kill(ctx, step)
            for site in range(cfg.sites):
                g = buf.array(npt, (H,), layout.gamma_offset(site + 1))
                if step == 0:
                    xv, rv, gv, total = setup_values(cfg, world, rank, site, n)
                    x[...], res[...], g[...] = _encode(xv, dt), _encode(rv, dt), _encode(gv, dt)
                out = arfuse.allreduce_fusion(input=x, workspace=ws, residual_in=res,
                                              residual_out=res, norm_out=y, rms_gamma=g,
                                              rms_eps=cfg.eps, dtype=dt, timeout=ctx.op_timeout)
                if out is None:
                    raise SetupError(f"allreduce_fusion returned None (fusion unavailable) at "
                                     f"step {step}, {site_name(cfg, site)}")
                result["ops"] += 1
                result["sites_fused"] += step == 0
                if step == 0:
                    result["checked_values"] += check_setup_values(cfg, site, total, rv, gv,
                                                                   res, y)
                del g
    finally:
        del x, res, y
    log(f"{result['ops']} fused ops ran on the eager plane; {result['checked_values']} values "
        "checked against the CPU reference", rank)
    return result


def _maybe_kill(ctx, step: int):
    kill = ctx.inject
    if kill is not None and kill[0] == ctx.rank and step == kill[1]:
        ctx.kill_own_sidecar(step)


def _setup_instream(ctx, ictx, ex, result: dict) -> dict:
    """Setup-only on the in-stream plane: one attachment serves every site (no per-site slot or
    plan); in host mode each site's op runs through the library on known data."""
    import numpy as np

    cfg, rank, world = ctx.cfg, ctx.rank, ctx.world
    H, n, dt = cfg.hidden, cfg.batch, cfg.dtype
    for tokens in sorted({cfg.batch, cfg.max_tokens}):
        why = ictx.why_not(tokens, H, dt)
        log(f"in-stream: {tokens} tokens x {H} {dt}: " +
            ("served fused" if why is None else f"not served fused ({why})"), rank)
    if ictx.why_not(n, H, dt) is not None:
        raise SetupError(f"the decode batch ({n} tokens x {H}) is not served fused on the "
                         f"in-stream plane: {ictx.why_not(n, H, dt)}")
    if ctx.device == "cuda":
        result["sites_fused"] = cfg.sites
        log(f"cuda --setup-only stops here: attached, {cfg.sites} sites served by one "
            "attachment (filling device memory needs torch)", rank)
        return result
    npt = np.uint16 if dt == "bf16" else np.float32
    x = _aligned((n, H), npt)
    res = _aligned((n, H), npt)
    y = _aligned((n, H), npt)
    gammas = _aligned((cfg.sites, H), npt)
    for step in range(cfg.steps):
        _maybe_kill(ctx, step)
        for site in range(cfg.sites):
            g = gammas[site]
            if step == 0:
                xv, rv, gv, total = setup_values(cfg, world, rank, site, n)
                x[...], res[...], g[...] = _encode(xv, dt), _encode(rv, dt), _encode(gv, dt)
            ictx.fused_allreduce_residual_rmsnorm(None, x.ctypes.data, res.ctypes.data,
                                                  res.ctypes.data, y.ctypes.data,
                                                  g.ctypes.data, n, H, dt, cfg.eps)
            result["ops"] += 1
            if step == 0:
                result["sites_fused"] += 1
                result["checked_values"] += check_setup_values(cfg, site, total, rv, gv, res, y)
        ictx.check()
    log(f"{result['ops']} fused ops ran on the in-stream plane (host mode, one attachment for "
        f"{cfg.sites} sites); {result['checked_values']} values checked against the CPU "
        "reference", rank)
    return result
