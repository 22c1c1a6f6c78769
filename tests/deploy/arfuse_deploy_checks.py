"""Static checks of the container image and the Kubernetes manifests against arfused's flags.

No Docker engine or cluster is needed: the Dockerfile is parsed as text, the manifests are rendered
with `kubectl kustomize` and checked as data. The flags come from server/daemon/options.cc (the
source of truth) or, when built, from `arfused --help`.

Every check returns a list of problems (strings naming the object and what is wrong); an empty
list means the input passed. tests/deploy/test_*.py run them on the real files and on doctored
copies, to prove each check catches what it is meant to catch.
"""
from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

REPO = Path(__file__).resolve().parents[2]
OPTIONS_CC = REPO / "server" / "daemon" / "options.cc"
FUSION_FLAGS_INC = REPO / "config" / "fusion_flags.inc"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
K8S = REPO / "deploy" / "k8s"

READINESS_SERVICE = "arfuse.v1.Fusion"
BACKEND_FLAG = "flashinfer-allreduce-fusion-backend"
DEPRECATED_FLAGS = {"enable-flashinfer-allreduce-fusion"}
MAX_UNIX_SOCKET_PATH = 107
# Seconds the startup budget must exceed --peer-timeout by, and tGPS must exceed --grace-period by.
STARTUP_MARGIN_S = 10
TERMINATION_MARGIN_S = 10


# ---------------------------------------------------------------------------------------------
# arfused's flags


@dataclass
class Flag:
    name: str  # hyphenated, as on the command line
    type: str  # the C++ type of the ABSL_FLAG
    default: str  # the C++ default expression, as written
    choices: tuple = ()  # allowed values where options.cc checks them with CheckOneOf

    @property
    def env(self) -> str:
        return "ARFUSE_" + self.name.replace("-", "_").upper()

    @property
    def is_bool(self) -> bool:
        return self.type == "bool"

    @property
    def env_settable(self) -> bool:
        # ParseDaemonCommandLine reads ARFUSE_CONFIG itself; help and version are CLI-only.
        return self.name not in ("help", "version")


def _split_top_level(text: str) -> list[str]:
    """Splits macro arguments at commas outside (), {}, <> and string literals."""
    parts, depth, cur, i, quote = [], 0, [], 0, None
    while i < len(text):
        ch = text[i]
        if quote:
            cur.append(ch)
            if ch == "\\":
                cur.append(text[i + 1])
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
            cur.append(ch)
        elif ch in "({<":
            depth += 1
            cur.append(ch)
        elif ch in ")}>":
            depth -= 1
            cur.append(ch)
        elif ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
        i += 1
    parts.append("".join(cur).strip())
    return parts


def _macro_calls(source: str, macro: str) -> list[list[str]]:
    calls = []
    for m in re.finditer(r"\b" + macro + r"\s*\(", source):
        depth, i, quote = 1, m.end(), None
        while depth and i < len(source):
            ch = source[i]
            if quote:
                if ch == "\\":
                    i += 1
                elif ch == quote:
                    quote = None
            elif ch in "\"'":
                quote = ch
            elif ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
            i += 1
        calls.append(_split_top_level(source[m.end(): i - 1]))
    return calls


def fusion_flags_from_table(path: Path = FUSION_FLAGS_INC) -> dict[str, Flag]:
    """The fusion flags (hyphenated name -> Flag) from their one declaration: a switch is a bool,
    a value unset by default an optional string, any other a string with the table's default;
    choices where the row names them and no parser."""
    flags = {}
    for args in _macro_calls(path.read_text(), "ARFUSE_FUSION_FLAG"):
        if len(args) != 8 or args[0] not in ("kSwitch", "kOptional", "kValue"):
            continue  # the macro's description in the header comment
        kind, ident, _field, _type, init, values, check = args[:7]
        ctype = {"kSwitch": "bool", "kOptional": "std::optional<std::string>"}.get(kind,
                                                                                 "std::string")
        default = init if kind == "kSwitch" else ("std::nullopt" if kind == "kOptional" else init)
        choices = () if check != "nullptr" or not values.strip('"') else \
            tuple("".join(re.findall(r'"([^"]*)"', values)).split("|"))
        hyphen = ident.replace("_", "-")
        flags[hyphen] = Flag(hyphen, ctype, default, choices)
    if not flags:
        raise ValueError(f"no ARFUSE_FUSION_FLAG row found in {path}")
    return flags


def flags_from_options_cc(path: Path = OPTIONS_CC) -> dict[str, Flag]:
    """arfused's own flags (hyphenated name -> Flag) from options.cc and, for the fusion flags,
    their table (config/fusion_flags.inc), which options.cc expands into its flags."""
    source = path.read_text()
    own = None
    m = re.search(r"OwnFlagNames\(\)\s*\{(.*?)return names;", source, re.S)
    if m:
        own = set(re.findall(r'"([a-z0-9_]+)"', m.group(1)))
    choices = {}
    for args in _macro_calls(source, "CheckOneOf"):
        if len(args) == 3 and args[0].startswith('"'):
            choices[args[0].strip('"')] = tuple(re.findall(r'"([^"]*)"', args[2]))
    flags = {}
    for args in _macro_calls(source, "ABSL_FLAG"):
        if len(args) < 3:
            continue
        ctype, name, default = args[0], args[1], args[2]
        if own is not None and name not in own:
            continue
        hyphen = name.replace("_", "-")
        flags[hyphen] = Flag(hyphen, ctype, default, choices.get(hyphen, ()))
    if not flags:
        raise ValueError(f"no ABSL_FLAG found in {path}")
    if path == OPTIONS_CC:
        flags.update(fusion_flags_from_table())
    return flags


def arfused_binary() -> Path | None:
    build = Path(os.environ.get("ARFUSE_BUILD_DIR", REPO / "build"))
    binary = build / "server" / "daemon" / "arfused"
    return binary if binary.is_file() and os.access(binary, os.X_OK) else None


def run_help(binary: Path) -> subprocess.CompletedProcess:
    """`arfused --help`. A build with CUDA links the driver's libcuda.so.1, which machines without a
    GPU lack; --help touches no GPU, so the toolkit's stub library stands in for it then."""
    out = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=30)
    if out.returncode == 0 or "libcuda.so.1" not in out.stderr:
        return out
    cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    stub = cuda / "lib64" / "stubs" / "libcuda.so"
    if not stub.exists():
        return out
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "libcuda.so.1").symlink_to(stub)
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = tmp + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        return subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=30,
                              env=env)


def flag_names_from_help(binary: Path) -> dict[str, str]:
    """Hyphenated flag name -> environment variable, from `arfused --help`."""
    out = run_help(binary)
    names = {}
    for m in re.finditer(r"^\s+--([a-z0-9-]+)\s+\(default: .*?; env (ARFUSE_[A-Z0-9_]+)\)",
                         out.stdout + out.stderr, re.M):
        names[m.group(1)] = m.group(2)
    return names


_BOOL_WORDS = {"true", "false", "t", "f", "yes", "no", "y", "n", "1", "0"}


def check_value(flag: Flag, value: str) -> str | None:
    """A reason the value would be refused (exit 2), or None. Shell expansions are not judged."""
    if "$" in value:
        return None
    t = flag.type
    if t == "bool":
        ok = value.lower() in _BOOL_WORDS
    elif t in ("int", "std::optional<int>", "int32_t", "int64_t", "uint32_t"):
        ok = re.fullmatch(r"[+-]?\d+", value) is not None
    elif t == "double":
        try:
            float(value)
            ok = value.strip() != ""
        except ValueError:
            ok = False
    else:
        ok = True
    if not ok:
        return f"'{value}' is not a valid {t}"
    if flag.choices and value not in flag.choices:
        return f"'{value}' is not one of {', '.join(flag.choices)}"
    return None


def default_value(flag: Flag) -> str | None:
    """The flag's default as text, where options.cc writes a literal."""
    d = flag.default.strip()
    if d in ("std::nullopt", "{}", '""'):
        return None
    if re.fullmatch(r"-?\d+(\.\d+)?", d) or d in ("true", "false"):
        return d
    if d.startswith('"') and d.endswith('"'):
        return d[1:-1]
    return None


# ---------------------------------------------------------------------------------------------
# Shell words, as the sidecars of the multi-node overlay use them ("exec arfused --rank=$((...))")

_ARITH = re.compile(r"\$\(\((.*?)\)\)")


def shell_words(script: str) -> list[str]:
    """shlex.split that keeps $((...)) in one word."""
    saved = []

    def hide(m):
        saved.append(m.group(0))
        return f"__ARITH{len(saved) - 1}__"

    words = shlex.split(_ARITH.sub(hide, script))
    return [re.sub(r"__ARITH(\d+)__", lambda m: saved[int(m.group(1))], w) for w in words]


def _eval_arith(expr: str, env: dict) -> int:
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return int(env[node.id])
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            a, b = ev(node.left), ev(node.right)
            return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        raise ValueError(expr)

    return ev(ast.parse(expr.strip(), mode="eval"))


def expand(value: str, env: dict) -> str | None:
    """Expands $((...)), ${VAR} and $VAR with env; None when something is unknown."""
    try:
        value = _ARITH.sub(lambda m: str(_eval_arith(m.group(1), env)), value)
    except (KeyError, ValueError, SyntaxError):
        return None
    unknown = []

    def var(m):
        name = m.group(1) or m.group(2)
        if name not in env:
            unknown.append(name)
            return ""
        return str(env[name])

    value = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)", var, value)
    return None if unknown else value


def parse_cli(tokens: list[str], flags: dict[str, Flag]) -> tuple[list[tuple[str, str]], list[str]]:
    """arfused's command-line tokens -> ([(flag, value)], problems), as TokenizeCommandLine does."""
    out, problems, i = [], [], 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if not tok.startswith("-"):
            problems.append(f"unexpected argument '{tok}' (arfused takes only flags)")
            continue
        body = tok.lstrip("-")
        name, eq, value = body.partition("=")
        name = name.replace("_", "-")
        if name not in flags and name.startswith("no") and name[2:] in flags \
                and flags[name[2:]].is_bool and not eq:
            out.append((name[2:], "false"))
            continue
        if name not in flags:
            problems.append(f"unknown flag --{name}")
            continue
        if not eq:
            if flags[name].is_bool:
                value = "true"
            elif i < len(tokens):
                value = tokens[i]
                i += 1
            else:
                problems.append(f"flag --{name} needs a value")
                continue
        out.append((name, value))
    return out, problems


# ---------------------------------------------------------------------------------------------
# Dockerfile


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list = field(default_factory=list)

    def all(self, keyword):
        return [i for i in self.instructions if i.keyword == keyword]


def parse_dockerfile(text: str) -> tuple[dict, list[Stage]]:
    """(global ARG defaults, stages). Handles continuations, comments and parser directives."""
    logical, buf, start = [], "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue  # comment lines inside a continued instruction
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        logical.append((start, buf.strip()))
        buf = ""
    if buf:
        logical.append((start, buf.strip()))
    global_args, stages = {}, []
    for line, text_ in logical:
        keyword, _, args = text_.partition(" ")
        keyword = keyword.upper()
        args = args.strip()
        if keyword == "FROM":
            m = re.match(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", args, re.I)
            stages.append(Stage(m.group(1), m.group(2)))
        elif not stages:
            if keyword == "ARG":
                k, _, v = args.partition("=")
                global_args[k.strip()] = v.strip().strip('"')
        else:
            stages[-1].instructions.append(Instruction(keyword, args, line))
    return global_args, stages


def substitute(text: str, variables: dict) -> str:
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)",
                  lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), text)


def exec_form(args: str) -> list[str] | None:
    """The JSON (exec) form of CMD/ENTRYPOINT, or None for the shell form."""
    import json

    args = args.strip()
    if args.startswith("["):
        try:
            value = json.loads(args)
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                return value
        except ValueError:
            pass
    return None


def env_pairs(args: str) -> dict:
    """ENV k=v k2="v 2" ... (or the legacy ENV k v)."""
    words = shlex.split(args)
    if words and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}
    return dict(w.split("=", 1) for w in words if "=" in w)


@dataclass
class Image:
    """What the final stage of the Dockerfile sets, as Kubernetes sees it."""
    entrypoint: list
    cmd: list
    env: dict
    user: str | None
    exposed: set


def image_from_dockerfile(text: str) -> Image:
    _, stages = parse_dockerfile(text)
    final = stages[-1]
    env, entrypoint, cmd, user, exposed = {}, [], [], None, set()
    for ins in final.instructions:
        if ins.keyword == "ENV":
            env.update(env_pairs(ins.args))
        elif ins.keyword == "ENTRYPOINT":
            entrypoint = exec_form(ins.args) or ["/bin/sh", "-c", ins.args]
            cmd = []  # ENTRYPOINT resets an inherited CMD
        elif ins.keyword == "CMD":
            cmd = exec_form(ins.args) or ["/bin/sh", "-c", ins.args]
        elif ins.keyword == "USER":
            user = ins.args.strip()
        elif ins.keyword == "EXPOSE":
            exposed.update(p.split("/")[0] for p in ins.args.split())
    return Image(entrypoint, cmd, env, user, exposed)


_BUILD_TOOLS = {"build-essential", "cmake", "ninja-build", "g++", "gcc", "clang", "make", "git",
                "pkg-config", "protobuf-compiler", "protobuf-compiler-grpc"}


def check_dockerfile(text: str, flags: dict[str, Flag]) -> list[str]:
    problems = []
    global_args, stages = parse_dockerfile(text)
    if len(stages) < 2:
        return ["Dockerfile: not multi-stage (a CUDA devel build stage and a CUDA runtime stage)"]
    build, final = stages[0], stages[-1]
    build_base = substitute(build.base, global_args)
    final_base = substitute(final.base, global_args)
    if not re.fullmatch(r"nvidia/cuda:13\.\d+(\.\d+)?-devel-ubuntu24\.04", build_base):
        problems.append(f"build stage: base {build_base} is not nvidia/cuda:13.x-devel-ubuntu24.04")
    if not re.fullmatch(r"nvidia/cuda:13\.\d+(\.\d+)?-runtime-ubuntu24\.04", final_base):
        problems.append(f"final stage: base {final_base} is not nvidia/cuda:13.x-runtime-ubuntu24.04")

    runs = [i.args for i in build.all("RUN")]
    if not any(re.search(r"(^|[\s;&|(])(\./)?scripts/setup(\s*$|\s*[;&|)]|\s+[^-])", r)
               for r in runs):
        problems.append("build stage: no RUN builds with scripts/setup (the script CI runs)")

    # Runtime stage: binaries from the build stage, runtime packages only.
    copies = " ".join(i.args for i in final.all("COPY") if "--from=" in i.args)
    for binary in ("arfused", "arfusectl"):
        if not re.search(r"\b" + binary + r"\b", copies):
            problems.append(f"final stage: {binary} is not copied from the build stage")
    for ins in final.all("RUN"):
        for m in re.finditer(r"apt-get\s+install\s+((?:[^&;|]|\\\s)*)", ins.args):
            for pkg in m.group(1).split():
                if pkg.startswith("-"):
                    continue
                if pkg.endswith("-dev") or pkg in _BUILD_TOOLS:
                    problems.append(f"final stage (line {ins.line}): installs build-time package {pkg}")

    image = image_from_dockerfile(text)
    if image.user is None:
        problems.append("final stage: no USER (the image would run as root)")
    else:
        uid = image.user.split(":")[0]
        if not uid.isdigit():
            problems.append(f"final stage: USER {image.user} is not numeric (Kubernetes cannot "
                            "verify runAsNonRoot for a user name)")
        elif int(uid) == 0:
            problems.append("final stage: USER is root")

    checks = final.all("HEALTHCHECK")
    if not checks:
        problems.append("final stage: no HEALTHCHECK")
    elif not re.search(r"\bCMD\b.*\barfusectl\s+health\b", checks[-1].args):
        problems.append("final stage: HEALTHCHECK does not run `arfusectl health`")

    # arfused's flags on ENTRYPOINT + CMD, and ARFUSE_* in ENV.
    argv = image.entrypoint + image.cmd
    if not argv or PurePosixPath(argv[0]).name != "arfused":
        problems.append(f"final stage: ENTRYPOINT does not run arfused: {argv}")
    else:
        parsed, errs = parse_cli(argv[1:], flags)
        problems += [f"final stage ENTRYPOINT/CMD: {e}" for e in errs]
        for name, value in parsed:
            why = check_value(flags[name], value)
            if why:
                problems.append(f"final stage ENTRYPOINT/CMD: --{name}: {why}")
    env_flags = {f.env: f for f in flags.values() if f.env_settable}
    for key, value in image.env.items():
        if key.startswith("ARFUSE_"):
            if key not in env_flags:
                problems.append(f"final stage: ENV {key} names no arfused flag")
            else:
                why = check_value(env_flags[key], value)
                if why:
                    problems.append(f"final stage: ENV {key}: {why}")
    if image.env.get("NCCL_NVLS_ENABLE") != "0":
        problems.append("final stage: ENV NCCL_NVLS_ENABLE=0 missing (NVLink multicast must stay off)")
    for key in ("ARFUSE_HEALTH_PORT", "ARFUSE_METRICS_PORT"):
        port = image.env.get(key)
        if port and port not in image.exposed:
            problems.append(f"final stage: {key}={port} is not EXPOSEd")
    if checks and "ARFUSE_HEALTH_PORT" in image.env:
        m = re.search(r"--addr[= ]\"?[^\s\"]*:(\$\{?ARFUSE_HEALTH_PORT\}?|\d+)", checks[-1].args)
        if not m or (m.group(1).isdigit() and m.group(1) != image.env["ARFUSE_HEALTH_PORT"]):
            problems.append("final stage: HEALTHCHECK does not probe the health port")
    return problems


def _dockerignore_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + r"\Z")


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Whether Docker leaves `path` (relative, '/'-separated) out of the build context."""
    parts = path.split("/")
    candidates = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.strip().strip("/")
        if pattern.startswith("./"):
            pattern = pattern[2:]
        rx = _dockerignore_regex(pattern)
        if any(rx.match(c) for c in candidates):
            excluded = not negate
    return excluded


def read_dockerignore(text: str) -> list[str]:
    return [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]


def build_inputs(repo: Path = REPO) -> list[str]:
    """The files the build stage needs: scripts/setup and every source CMake may read."""
    needed = ["scripts/setup", "CMakeLists.txt"]
    for top in ("proto", "kernels", "common", "config", "server", "client", "tools", "tests",
                "bench"):
        root = repo / top
        if not root.is_dir():
            continue
        for p in root.rglob("*"):
            rel = p.relative_to(repo).as_posix()
            if p.is_file() and "__pycache__" not in rel and not rel.endswith(".pyc") \
                    and not re.search(r"_pb2(_grpc)?\.py$", rel):
                needed.append(rel)
    return needed


def check_dockerignore(text: str, needed: list[str]) -> list[str]:
    patterns = read_dockerignore(text)
    dropped = [p for p in needed if dockerignore_excludes(patterns, p)]
    if not dropped:
        return []
    shown = ", ".join(dropped[:5]) + (f" (+{len(dropped) - 5} more)" if len(dropped) > 5 else "")
    return [f".dockerignore drops files the build needs: {shown}"]


# ---------------------------------------------------------------------------------------------
# Kubernetes manifests


def find_kubectl() -> str | None:
    return os.environ.get("KUBECTL") or shutil.which("kubectl")


def kustomize(directory: Path, kubectl: str) -> list[dict]:
    import yaml

    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True,
                         timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory} failed:\n{out.stderr}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def overlays() -> list[Path]:
    return sorted(p for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())


def kustomizations() -> list[Path]:
    """Every directory under deploy/k8s with a kustomization.yaml that renders on its own (not a
    Component, which only an overlay can render)."""
    out = []
    for k in sorted(K8S.rglob("kustomization.yaml")):
        if not re.search(r"^kind:\s*Component\s*$", k.read_text(), re.M):
            out.append(k.parent)
    return out


@dataclass
class PodTemplate:
    where: str  # "Deployment/llm"
    spec: dict
    metadata: dict
    pods_per_group: int  # LeaderWorkerSet size, else 1
    lws: dict | None  # the LeaderWorkerSet spec, when it is one


def pod_templates(docs: list[dict]) -> list[PodTemplate]:
    out = []
    for d in docs:
        kind, name = d.get("kind"), d.get("metadata", {}).get("name")
        spec = d.get("spec") or {}
        if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
            t = spec.get("template") or {}
            out.append(PodTemplate(f"{kind}/{name}", t.get("spec") or {}, t.get("metadata") or {}, 1,
                                   None))
        elif kind == "Pod":
            out.append(PodTemplate(f"Pod/{name}", spec, d.get("metadata") or {}, 1, None))
        elif kind == "LeaderWorkerSet":
            lwt = spec.get("leaderWorkerTemplate") or {}
            size = int(lwt.get("size", 1))
            for role in ("leaderTemplate", "workerTemplate"):
                t = lwt.get(role)
                if t:
                    out.append(PodTemplate(f"LeaderWorkerSet/{name} {role}", t.get("spec") or {},
                                           t.get("metadata") or {}, size, spec))
    return out


@dataclass
class Sidecar:
    container: dict
    native: bool  # an init container (native sidecar)
    index: int  # position among the pod's init containers (native) or containers
    words: list  # arfused's command-line words, shell expansions unexpanded
    shell: bool


def _image_name(image: str) -> str:
    image = image.split("@")[0]
    last = image.rsplit("/", 1)[-1]
    return last.split(":")[0]


def arfused_words(container: dict, image: Image, image_name: str = "arfuse"):
    """(words after `arfused`, ran through a shell) or None when the container runs no arfused."""
    cmd, args = container.get("command"), container.get("args")
    if cmd is None:
        if _image_name(container.get("image", "")) != image_name:
            return None
        argv = list(image.entrypoint) + list(args if args is not None else image.cmd)
    else:
        argv = list(cmd) + list(args or [])
    if not argv:
        return None
    if PurePosixPath(argv[0]).name in ("sh", "bash", "dash") and "-c" in argv[1:]:
        script = argv[argv.index("-c") + 1] if argv.index("-c") + 1 < len(argv) else ""
        words = shell_words(script)
        for k, w in enumerate(words):
            if PurePosixPath(w).name == "arfused":
                return words[k + 1:], True
        return None
    if PurePosixPath(argv[0]).name == "arfused":
        return argv[1:], False
    return None


def container_env(container: dict, configmaps: dict, base: dict | None = None) -> dict:
    """name -> (value, source) as the container sees it (image ENV < envFrom < env)."""
    env = {k: (v, "image") for k, v in (base or {}).items()}
    for src in container.get("envFrom") or []:
        ref = src.get("configMapRef")
        if ref and ref.get("name") in configmaps:
            prefix = src.get("prefix", "")
            for k, v in (configmaps[ref["name"]].get("data") or {}).items():
                env[prefix + k] = (str(v), f"ConfigMap/{ref['name']}")
    for e in container.get("env") or []:
        if "value" in e:
            env[e["name"]] = (str(e["value"]), "env")
        else:
            env[e["name"]] = (None, "env (valueFrom)")
    return env


def _probe_budget(probe: dict) -> float:
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * \
        probe.get("failureThreshold", 3)


def _claims(container: dict) -> list[str]:
    return [c.get("name") for c in ((container.get("resources") or {}).get("claims") or [])]


def _mounts(container: dict) -> dict:
    return {m["mountPath"].rstrip("/") or "/": m["name"] for m in container.get("volumeMounts") or []}


def check_manifests(docs: list[dict], flags: dict[str, Flag], image: Image,
                    image_name: str = "arfuse") -> list[str]:
    problems = []
    configmaps = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "ConfigMap"}
    claim_templates = {d["metadata"]["name"] for d in docs if d.get("kind") == "ResourceClaimTemplate"}
    domains = [d for d in docs if d.get("kind") == "ComputeDomain"]
    for cd in domains:
        name = (((cd.get("spec") or {}).get("channel") or {}).get("resourceClaimTemplate") or {}).get("name")
        if name:
            claim_templates.add(name)
    rct_counts = {}
    for d in docs:
        if d.get("kind") == "ResourceClaimTemplate":
            for req in (((d.get("spec") or {}).get("spec") or {}).get("devices") or {}).get("requests") or []:
                exact = req.get("exactly") or req
                if exact.get("allocationMode", "ExactCount") == "ExactCount":
                    rct_counts[d["metadata"]["name"]] = int(exact.get("count", 1))
    env_flags = {f.env: f for f in flags.values() if f.env_settable}

    templates = pod_templates(docs)
    found_any = False
    for t in templates:
        spec = t.spec
        where = t.where
        inits = spec.get("initContainers") or []
        mains = spec.get("containers") or []
        sidecars = []
        for native, group in ((True, inits), (False, mains)):
            for idx, c in enumerate(group):
                w = arfused_words(c, image, image_name)
                if w is not None:
                    sidecars.append(Sidecar(c, native, idx, w[0], w[1]))
        if not sidecars:
            continue
        found_any = True
        others = [c for c in mains if all(c is not s.container for s in sidecars)]

        # --- references -------------------------------------------------------------------
        for c in inits + mains:
            for src in c.get("envFrom") or []:
                ref = src.get("configMapRef")
                if ref and ref.get("name") not in configmaps and not ref.get("optional"):
                    problems.append(f"{where} {c['name']}: envFrom ConfigMap {ref.get('name')} "
                                    "is not in the rendered output")
        pod_claims = {}
        for rc in spec.get("resourceClaims") or []:
            tmpl = rc.get("resourceClaimTemplateName")
            pod_claims[rc["name"]] = tmpl
            if tmpl and tmpl not in claim_templates:
                problems.append(f"{where}: resourceClaimTemplate {tmpl} is not in the rendered output")

        # --- pod-level settings -----------------------------------------------------------
        if spec.get("shareProcessNamespace") is not True:
            problems.append(f"{where}: shareProcessNamespace must be true (CUDA IPC across containers)")
        if spec.get("enableServiceLinks", True) is not False:
            problems.append(f"{where}: enableServiceLinks must be false (Service variables such as "
                            "ARFUSE_HEALTH_PORT=tcp://... would reach arfused)")
        volumes = {v["name"]: v for v in spec.get("volumes") or []}

        # --- each sidecar: flags and environment --------------------------------------------
        per_pod = len(sidecars)
        group_env_examples = []
        resolved = []  # per sidecar: dict flag -> value (worker 0) and the raw per-worker views
        for s in sidecars:
            c = s.container
            cname = f"{where} {c['name']}"
            env = container_env(c, configmaps, image.env)
            for key, (value, source) in env.items():
                if not key.startswith("ARFUSE_"):
                    continue
                if key not in env_flags:
                    problems.append(f"{cname}: {key} (from {source}) names no arfused flag")
                elif value is not None:
                    why = check_value(env_flags[key], value)
                    if why:
                        problems.append(f"{cname}: {key} (from {source}): {why}")
            cli, errs = parse_cli(s.words, flags)
            problems += [f"{cname}: {e}" for e in errs]
            for name, value in cli:
                why = check_value(flags[name], value)
                if why:
                    problems.append(f"{cname}: --{name}: {why}")
                if name in DEPRECATED_FLAGS:
                    problems.append(f"{cname}: --{name} is deprecated; use --{BACKEND_FLAG}")
                if name == BACKEND_FLAG:
                    problems.append(f"{cname}: --{BACKEND_FLAG} on the command line overrides the "
                                    "ConfigMap; set ARFUSE_FLASHINFER_ALLREDUCE_FUSION_BACKEND there")
            for key in env:
                if key.startswith("ARFUSE_") and key in env_flags and \
                        env_flags[key].name in DEPRECATED_FLAGS:
                    problems.append(f"{cname}: {key} is deprecated; use "
                                    "ARFUSE_FLASHINFER_ALLREDUCE_FUSION_BACKEND")
            group_env_examples.append(env)

            def value_of(flag, workers_env, cli=cli, env=env):
                for n, v in reversed(cli):
                    if n == flag:
                        return expand(v, workers_env), "cli"
                e = env.get(flags[flag].env)
                if e is not None:
                    return (expand(e[0], workers_env) if e[0] is not None else None), e[1]
                return default_value(flags[flag]), "default"

            resolved.append(value_of)

        lws_env = lambda w: {"LWS_WORKER_INDEX": str(w), "LWS_GROUP_SIZE": str(t.pods_per_group),
                             "LWS_LEADER_ADDRESS": "leader.example"}
        views = [lws_env(w) if t.lws is not None else {} for w in range(t.pods_per_group)]

        def num(value, cast=float):
            try:
                return cast(value)
            except (TypeError, ValueError):
                return None

        # --- group shape: world size, nodes, ranks, GPUs ------------------------------------
        world = [num(r("world-size", views[0])[0], int) for r in resolved]
        nnodes = [num(r("nnodes", views[0])[0], int) for r in resolved]
        if len(set(world)) != 1 or world[0] is None:
            problems.append(f"{where}: sidecars disagree on or leave unset --world-size: {world}")
        elif world[0] != per_pod * t.pods_per_group:
            problems.append(f"{where}: --world-size={world[0]} but the group has "
                            f"{per_pod * t.pods_per_group} sidecars ({per_pod} per pod x "
                            f"{t.pods_per_group} pods)")
        if len(set(nnodes)) != 1 or nnodes[0] != t.pods_per_group:
            problems.append(f"{where}: --nnodes={nnodes} but the group spans {t.pods_per_group} pod(s)")
        ranks = []
        for view in views:
            for r in resolved:
                ranks.append(num(r("rank", view)[0], int))
        if None in ranks or sorted(ranks) != list(range(len(ranks))):
            problems.append(f"{where}: ranks across the group are not 0..{len(ranks) - 1}: {ranks}")
        gpus = [num(r("gpu", views[0])[0], int) for r in resolved]
        gpu_claims = set()
        for s in sidecars:
            gpu_claims.update(n for n in _claims(s.container) if n in pod_claims)
        counts = [rct_counts.get(pod_claims.get(n)) for n in gpu_claims]
        counts = [c for c in counts if c is not None]
        if sorted(g for g in gpus if g is not None) != sorted(set(g for g in gpus if g is not None)) \
                or None in gpus or any(g < 0 for g in gpus):
            problems.append(f"{where}: each sidecar needs its own --gpu: {gpus}")
        elif counts and max(gpus) >= max(counts):
            problems.append(f"{where}: --gpu values {gpus} exceed the {max(counts)} claimed GPUs")
        if counts and per_pod != max(counts):
            problems.append(f"{where}: {per_pod} sidecars but the GPU claim holds {max(counts)} devices")

        # --- GPU claim shared by the sidecars and the model server -----------------------------
        for s in sidecars:
            if not _claims(s.container):
                problems.append(f"{where} {s.container['name']}: no resources.claims (no GPU visible)")
        sidecar_claims = set.intersection(*(set(_claims(s.container)) for s in sidecars))
        for c in others:
            if sidecar_claims and not sidecar_claims & set(_claims(c)):
                problems.append(f"{where} {c['name']}: does not share the sidecars' GPU claim "
                                f"({', '.join(sorted(sidecar_claims))})")

        # --- sockets in a shared emptyDir -----------------------------------------------------
        sockets = []
        for s, r in zip(sidecars, resolved):
            cname = f"{where} {s.container['name']}"
            sock, _ = r("socket", views[0])
            if not sock:
                # arfused's default: $XDG_RUNTIME_DIR/arfuse or /run/arfuse, ".rank<r>" for r > 0.
                rank = num(r("rank", views[0])[0], int) or 0
                xdg = container_env(s.container, configmaps, image.env).get("XDG_RUNTIME_DIR")
                root = f"{xdg[0]}/arfuse" if xdg and xdg[0] else "/run/arfuse"
                sock = f"{root}/arfused.sock" + (f".rank{rank}" if rank > 0 else "")
            sockets.append(sock)
            if len(sock.encode()) > MAX_UNIX_SOCKET_PATH:
                problems.append(f"{cname}: socket path {sock} is longer than {MAX_UNIX_SOCKET_PATH} bytes")
            directory = str(PurePosixPath(sock).parent)
            mounts = _mounts(s.container)
            vol = mounts.get(directory)
            if vol is None or "emptyDir" not in volumes.get(vol, {}):
                problems.append(f"{cname}: socket directory {directory} is not an emptyDir mounted "
                                "in this container")
                continue
            for c in others:
                if _mounts(c).get(directory) != vol:
                    problems.append(f"{where} {c['name']}: does not mount volume {vol} at {directory} "
                                    f"(the socket of {s.container['name']})")
        if len(set(sockets)) != len(sockets):
            problems.append(f"{where}: sidecars share a socket path: {sockets}")

        # --- probes on the health port --------------------------------------------------------
        used_ports = {}
        native_sidecars = [s for s in sidecars if s.native]
        last_native = max((s.index for s in native_sidecars), default=None)
        gating = []
        for s, r in zip(sidecars, resolved):
            c = s.container
            cname = f"{where} {c['name']}"
            if s.native and c.get("restartPolicy") != "Always":
                problems.append(f"{cname}: an init container without restartPolicy: Always never "
                                "exits and blocks the pod; make it a native sidecar")
            host = r("health-host", views[0])[0]
            if host not in (None, "", "0.0.0.0", "::", "[::]"):
                problems.append(f"{cname}: --health-host={host}: the kubelet probes the pod IP")
            port = num(r("health-port", views[0])[0], int)
            if not port or port <= 0:
                problems.append(f"{cname}: --health-port is {port}: probes need a fixed port")
            for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
                probe = c.get(kind)
                if not probe:
                    problems.append(f"{cname}: no {kind}")
                    continue
                g = probe.get("grpc")
                if not g:
                    problems.append(f"{cname}: {kind} is not a grpc probe")
                    continue
                if g.get("port") != port:
                    problems.append(f"{cname}: {kind} port {g.get('port')} != --health-port {port}")
                service = g.get("service", "") or ""
                if kind == "livenessProbe" and service != "":
                    problems.append(f"{cname}: livenessProbe service '{service}' must be \"\" "
                                    "(liveness never depends on peers)")
                if kind == "readinessProbe" and service != READINESS_SERVICE:
                    problems.append(f"{cname}: readinessProbe service '{service}' must be "
                                    f"'{READINESS_SERVICE}'")
                if kind == "startupProbe":
                    if service not in ("", READINESS_SERVICE):
                        problems.append(f"{cname}: startupProbe service '{service}' is neither \"\" "
                                        f"nor '{READINESS_SERVICE}'")
                    if service == READINESS_SERVICE:
                        gating.append((s, probe, r))
                        if s.native and s.index != last_native:
                            problems.append(
                                f"{cname}: startupProbe waits for '{READINESS_SERVICE}', but native "
                                "sidecars after it start only once it passes, and the group cannot "
                                "form without them (deadlock); only the last sidecar may gate")
            for p in c.get("ports") or []:
                cp = p.get("containerPort")
                if cp in used_ports:
                    problems.append(f"{cname}: port {cp} also used by {used_ports[cp]} (one network "
                                    "namespace per pod)")
                used_ports[cp] = c["name"]
            declared = {p.get("containerPort") for p in c.get("ports") or []}
            if port and port not in declared:
                problems.append(f"{cname}: health port {port} is not a containerPort")
        if not gating:
            problems.append(f"{where}: no sidecar's startupProbe covers the peer rendezvous (the "
                            f"last one should check '{READINESS_SERVICE}')")
        for s, probe, r in gating:
            timeout = num(r("peer-timeout", views[0])[0])
            if timeout is None:
                problems.append(f"{where} {s.container['name']}: --peer-timeout unresolved")
            elif _probe_budget(probe) < timeout + STARTUP_MARGIN_S:
                problems.append(f"{where} {s.container['name']}: startupProbe budget "
                                f"{_probe_budget(probe):g} s does not cover --peer-timeout {timeout:g} s "
                                f"+ {STARTUP_MARGIN_S} s")

        # --- metrics and their scrape annotations ---------------------------------------------
        metrics_ports = []
        for s, r in zip(sidecars, resolved):
            mp = num(r("metrics-port", views[0])[0], int)
            metrics_ports.append(mp)
            if mp is None or mp <= 0:
                problems.append(f"{where} {s.container['name']}: --metrics-port {mp}: metrics off "
                                "or on a random port")
            elif mp not in {p.get("containerPort") for p in s.container.get("ports") or []}:
                problems.append(f"{where} {s.container['name']}: metrics port {mp} is not a containerPort")
        annotations = t.metadata.get("annotations") or {}
        if annotations.get("prometheus.io/scrape") != "true":
            problems.append(f"{where}: pod annotation prometheus.io/scrape is not \"true\"")
        ann_port = num(annotations.get("prometheus.io/port"), int)
        if ann_port not in metrics_ports:
            problems.append(f"{where}: prometheus.io/port {annotations.get('prometheus.io/port')} is "
                            f"no sidecar's --metrics-port {metrics_ports}")

        # --- shutdown ---------------------------------------------------------------------------
        grace = max((num(r("grace-period", views[0])[0]) or 0) for r in resolved)
        tgps = spec.get("terminationGracePeriodSeconds", 30)
        if tgps < grace + TERMINATION_MARGIN_S:
            problems.append(f"{where}: terminationGracePeriodSeconds {tgps} does not cover "
                            f"--grace-period {grace:g} s + {TERMINATION_MARGIN_S} s")

        # --- backend from the ConfigMap ---------------------------------------------------------
        for s, env in zip(sidecars, group_env_examples):
            value, source = env.get(flags[BACKEND_FLAG].env, (None, None))
            if value is None or not (source or "").startswith("ConfigMap/"):
                problems.append(f"{where} {s.container['name']}: the backend does not come from a "
                                "ConfigMap (ARFUSE_FLASHINFER_ALLREDUCE_FUSION_BACKEND)")

        # --- GPU environment: NVLS off, MPS shared ---------------------------------------------
        gpu_containers = [c for c in inits + mains if set(_claims(c)) & set(pod_claims)]
        mps_dirs = set()
        for c in gpu_containers:
            env = container_env(c, configmaps, image.env if _image_name(c.get("image", "")) == image_name else None)
            nvls = env.get("NCCL_NVLS_ENABLE", (None,))[0]
            if nvls != "0":
                problems.append(f"{where} {c['name']}: NCCL_NVLS_ENABLE={nvls} (must be 0: NVLink "
                                "multicast stays off)")
            pipe = env.get("CUDA_MPS_PIPE_DIRECTORY", (None,))[0]
            if not pipe:
                problems.append(f"{where} {c['name']}: CUDA_MPS_PIPE_DIRECTORY not set (MPS)")
                continue
            mps_dirs.add(pipe)
            vol = _mounts(c).get(pipe.rstrip("/"))
            if vol is None or "emptyDir" not in volumes.get(vol, {}) and "hostPath" not in volumes.get(vol, {}):
                problems.append(f"{where} {c['name']}: CUDA_MPS_PIPE_DIRECTORY {pipe} is not a "
                                "shared volume mounted in this container")
        if len(mps_dirs) > 1:
            problems.append(f"{where}: containers disagree on CUDA_MPS_PIPE_DIRECTORY: {sorted(mps_dirs)}")
        daemons = [k for k, c in enumerate(inits)
                   if any("nvidia-cuda-mps-control" in str(x) for x in (c.get("command") or []) + (c.get("args") or []))]
        hostpath_pipe = any("hostPath" in volumes.get(_mounts(c).get(d.rstrip("/"), ""), {})
                            for c in gpu_containers for d in mps_dirs)
        if not daemons and not hostpath_pipe:
            problems.append(f"{where}: no MPS control daemon (init container running "
                            "nvidia-cuda-mps-control) and no host MPS pipe directory")
        elif daemons and native_sidecars and min(s.index for s in native_sidecars) < daemons[0]:
            problems.append(f"{where}: the MPS daemon starts after an arfused sidecar")

        # --- several nodes -----------------------------------------------------------------------
        if t.pods_per_group > 1:
            addrs = {r("peer-addr", views[0])[0] for r in resolved}
            if None in addrs or "" in addrs or len(addrs) != 1:
                problems.append(f"{where}: every sidecar needs the same --peer-addr (rank 0's "
                                f"rendezvous): {sorted(map(str, addrs))}")
            else:
                port = num(next(iter(addrs)).rsplit(":", 1)[-1], int)
                declared = {p.get("containerPort") for s in sidecars for p in s.container.get("ports") or []}
                if port not in declared:
                    problems.append(f"{where}: --peer-addr port {port} is not a containerPort")
            # The TCP peer channel takes only mutual TLS (docs/peers.md): every sidecar names a
            # certificate, its key and the group's CA (--peer-tls-*, else --listen's --tls-*),
            # each inside a Secret volume it mounts, and the group's sidecars share that Secret.
            secrets = set()
            for s, r in zip(sidecars, resolved):
                cname = f"{where} {s.container['name']}"
                mounts = _mounts(s.container)
                pairs = (("peer-tls-cert", "tls-cert"), ("peer-tls-key", "tls-key"),
                         ("peer-tls-ca", "tls-client-ca"))
                own = any(r(peer, views[0])[0] for peer, _ in pairs)
                for peer, listen in pairs:
                    path = r(peer if own else listen, views[0])[0]
                    if not path:
                        problems.append(f"{cname}: no --{peer}: the peer channel across nodes "
                                        "takes only mutual TLS")
                        continue
                    vol = next((v for m, v in mounts.items() if path.startswith(m + "/")), None)
                    secret = ((volumes.get(vol) or {}).get("secret") or {}).get("secretName")
                    if secret is None:
                        problems.append(f"{cname}: --{peer} {path} is not in a Secret volume "
                                        "this container mounts")
                    else:
                        secrets.add(secret)
            if len(secrets) > 1:
                problems.append(f"{where}: the sidecars' peer TLS comes from different Secrets "
                                f"{sorted(secrets)}: one group, one CA")
            if t.lws is not None and t.lws.get("startupPolicy") == "LeaderReady":
                problems.append(f"{where}: startupPolicy LeaderReady deadlocks (the leader's sidecars "
                                "become ready only once the workers' have joined)")
            backends = {(env.get(flags[BACKEND_FLAG].env) or (None,))[0] for env in group_env_examples}
            if "mnnvl" in backends:
                channel_names = {
                    (((cd.get("spec") or {}).get("channel") or {}).get("resourceClaimTemplate") or {}).get("name")
                    for cd in domains}
                channel_claims = {n for n, tmpl in pod_claims.items() if tmpl in channel_names}
                if not channel_claims:
                    problems.append(f"{where}: mnnvl across nodes needs a ComputeDomain IMEX channel claim")
                for s in sidecars:
                    if channel_claims and not channel_claims & set(_claims(s.container)):
                        problems.append(f"{where} {s.container['name']}: no IMEX channel claim")
    if not found_any:
        problems.append("no workload runs arfused")
    return problems


# ---------------------------------------------------------------------------------------------
# The device-plugin layout: the sidecars inside the model server's container (launch.sh)


def is_device_plugin(docs: list[dict]) -> bool:
    return any("nvidia.com/gpu" in ((c.get("resources") or {}).get("limits") or {})
               for t in pod_templates(docs) for c in t.spec.get("containers") or [])


def launch_script_flags(script: str) -> list[str]:
    """The --flags of the arfused command line in a launch script."""
    for line in script.splitlines():
        words = line.split()
        if words and words[0] == "arfused":
            return [w[2:].split("=")[0] for w in words[1:] if w.startswith("--")]
    return []


def check_device_plugin(docs: list[dict], flags: dict[str, Flag]) -> list[str]:
    problems = []
    configmaps = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "ConfigMap"}
    config = next((d for n, d in configmaps.items() if n.startswith("arfuse-config")), None)
    world = int(((config or {}).get("data") or {}).get("ARFUSE_WORLD_SIZE", "0"))
    scripts = [d for n, d in configmaps.items() if n.startswith("arfuse-launch")]
    if not scripts or "launch.sh" not in (scripts[0].get("data") or {}):
        return ["no arfuse-launch ConfigMap with launch.sh"]
    script = scripts[0]["data"]["launch.sh"]
    used = launch_script_flags(script)
    if not used:
        problems.append("launch.sh starts no arfused")
    problems += [f"launch.sh: unknown flag --{f}" for f in used if f not in flags]
    for t in pod_templates(docs):
        if t.spec.get("resourceClaims"):
            problems.append(f"{t.where}: the device-plugin layout claims no DRA devices")
        if t.spec.get("enableServiceLinks", True) is not False:
            problems.append(f"{t.where}: enableServiceLinks must be false")
        gpu = [c for c in t.spec.get("containers") or []
               if "nvidia.com/gpu" in ((c.get("resources") or {}).get("limits") or {})]
        if len(gpu) != 1:
            problems.append(f"{t.where}: exactly one container holds the GPUs, not {len(gpu)}")
            continue
        c = gpu[0]
        count = int(c["resources"]["limits"]["nvidia.com/gpu"])
        if count != world:
            problems.append(f"{t.where} {c['name']}: nvidia.com/gpu {count} != ARFUSE_WORLD_SIZE {world}")
        if (c.get("command") or [])[-1:] != ["/opt/arfuse/launch.sh"]:
            problems.append(f"{t.where} {c['name']}: the command is not /opt/arfuse/launch.sh")
        if "/opt/arfuse" not in _mounts(c):
            problems.append(f"{t.where} {c['name']}: launch.sh is not mounted at /opt/arfuse")
        ports = {p.get("containerPort") for p in c.get("ports") or []}
        for r in range(world):
            for base in (9310, 9330):
                if base + r not in ports:
                    problems.append(f"{t.where} {c['name']}: port {base + r} (rank {r}) is not a "
                                    "containerPort")
        env = container_env(c, configmaps)
        if env.get("NCCL_NVLS_ENABLE", (None,))[0] != "0":
            problems.append(f"{t.where} {c['name']}: NCCL_NVLS_ENABLE must be 0")
        for probe in ("startupProbe", "livenessProbe"):
            cmd = ((c.get(probe) or {}).get("exec") or {}).get("command") or []
            if cmd[:3] != ["arfusectl", "health", "--all"]:
                problems.append(f"{t.where} {c['name']}: {probe} does not check every rank "
                                "(arfusectl health --all)")
    return problems
