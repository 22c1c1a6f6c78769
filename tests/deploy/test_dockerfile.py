"""The Dockerfile and .dockerignore, checked statically (no Docker engine on our machines)."""
import re

import pytest

import arfuse_deploy_checks as checks


def test_dockerfile_passes(dockerfile_text, flags):
    assert checks.check_dockerfile(dockerfile_text, flags) == []


def test_dockerignore_keeps_every_build_input():
    needed = checks.build_inputs()
    assert "scripts/setup" in needed and "server/daemon/options.cc" in needed
    assert checks.check_dockerignore(checks.DOCKERIGNORE.read_text(), needed) == []


def test_dockerignore_leaves_out_local_build_trees():
    patterns = checks.read_dockerignore(checks.DOCKERIGNORE.read_text())
    for path in ("build/server/daemon/arfused", "build-gpu/CMakeCache.txt", ".git/HEAD",
                 "client/python/arfuse/__pycache__/x.pyc"):
        assert checks.dockerignore_excludes(patterns, path), path


def test_dockerfile_flags_exist_in_built_arfused(image, arfused_help):
    argv = image.entrypoint + image.cmd
    used = {w[2:].split("=")[0] for w in argv[1:] if w.startswith("--")}
    assert used <= set(arfused_help), used - set(arfused_help)
    envs = {k for k in image.env if k.startswith("ARFUSE_")}
    assert envs <= set(arfused_help.values()), envs - set(arfused_help.values())


def test_options_cc_parse_matches_built_help(flags, arfused_help):
    # The parser of options.cc (used where arfused is not built) sees the flags --help lists.
    assert set(flags) == set(arfused_help)


# --- the checker catches what it should, on doctored copies ------------------------------------

def _replace(old, new, count=1):
    def doctor(text):
        assert old in text, old
        return text.replace(old, new, count)
    return doctor


def _drop_lines(pattern):
    def doctor(text):
        out, skipping = [], False
        for line in text.splitlines():
            if re.match(pattern, line) or (skipping and line.startswith(" ")):
                skipping = line.rstrip().endswith("\\") or re.match(pattern, line) is not None
                continue
            skipping = False
            out.append(line)
        return "\n".join(out) + "\n"
    return doctor


def _single_stage(text):
    start = text.index("FROM nvidia/cuda:${CUDA_VERSION}-runtime")
    head = text[: text.index("FROM nvidia/cuda:${CUDA_VERSION}-devel")]
    return head + text[start:]


DOCTORED = {
    "single stage": (_single_stage, "not multi-stage"),
    "root user": (_replace("USER 10001:10001", "USER root"), "not numeric"),
    "uid 0": (_replace("USER 10001:10001", "USER 0:0"), "USER is root"),
    "no user": (_drop_lines(r"^USER "), "no USER"),
    "no healthcheck": (_drop_lines(r"^HEALTHCHECK "), "no HEALTHCHECK"),
    "healthcheck with curl": (
        _replace('CMD arfusectl health --addr "127.0.0.1:${ARFUSE_HEALTH_PORT}" --timeout-ms 3000',
                 "CMD curl -f http://127.0.0.1:9310/"), "arfusectl health"),
    "unknown flag in CMD": (_replace('CMD ["--log-level=info"]', 'CMD ["--no-such-flag=1"]'),
                            "unknown flag --no-such-flag"),
    "bad value in CMD": (_replace('CMD ["--log-level=info"]', 'CMD ["--metrics-port=lots"]'),
                         "--metrics-port: 'lots' is not a valid int"),
    "deprecated env name typo": (_replace("ARFUSE_METRICS_PORT=9330", "ARFUSE_METRIC_PORT=9330"),
                                 "ARFUSE_METRIC_PORT names no arfused flag"),
    "bad backend in env": (_replace("ARFUSE_METRICS_PORT=9330 \\",
                                    "ARFUSE_METRICS_PORT=9330 ARFUSE_FLASHINFER_ALLREDUCE_FUSION_BACKEND=fast \\"),
                           "'fast' is not one of auto, trtllm, mnnvl"),
    "nvls not off": (_replace("NCCL_NVLS_ENABLE=0", "NCCL_NVLS_ENABLE=1"), "NCCL_NVLS_ENABLE=0"),
    "health port not exposed": (_replace("EXPOSE 9310 9330 9350", "EXPOSE 9330 9350"),
                                "ARFUSE_HEALTH_PORT=9310 is not EXPOSEd"),
    "build without scripts/setup": (
        _replace('RUN ARFUSE_GIT_REVISION="${GIT_REVISION}" scripts/setup\n',
                 "RUN cmake -S . -B build -G Ninja && cmake --build build\n"),
        "scripts/setup"),
    "dev package at run time": (_replace("libgrpc++1.51t64 \\", "libgrpc++-dev \\"),
                                "build-time package libgrpc++-dev"),
    "binaries not copied": (_replace("COPY --from=build /out/arfused /out/arfusectl /usr/local/bin/",
                                     "COPY --from=build /out/arfused /usr/local/bin/"),
                            "arfusectl is not copied"),
    "devel base at run time": (_replace("-runtime-${UBUNTU_TAG} AS runtime", "-devel-${UBUNTU_TAG} AS runtime"),
                               "runtime-ubuntu24.04"),
}


@pytest.mark.parametrize("case", sorted(DOCTORED))
def test_checker_catches_doctored_dockerfile(case, dockerfile_text, flags):
    doctor, expected = DOCTORED[case]
    problems = checks.check_dockerfile(doctor(dockerfile_text), flags)
    assert any(expected in p for p in problems), problems


def test_checker_catches_dockerignore_dropping_sources():
    text = checks.DOCKERIGNORE.read_text() + "\nserver\n"
    problems = checks.check_dockerignore(text, checks.build_inputs())
    assert problems and "server/" in problems[0]
    # A negation brings a path back.
    text += "!server\n"
    assert checks.check_dockerignore(text, checks.build_inputs()) == []
