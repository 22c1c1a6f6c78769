"""The include rules of docs/architecture.md ("Where the code lives"), checked on the tree: each
layer includes only the layers below it, the server libraries include no gRPC, and the client
side includes only what that section names. The layer table is read from the page, so the page
and the tree cannot drift apart silently."""
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "architecture.md"
SOURCES = (".h", ".hpp", ".cc", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+["<]([^">]+)[">]', re.M)
ORDER = ["kernels", "server libraries", "gRPC services", "binaries"]

# What the client side (client/, outside its binaries) may include of the tree, as the section's
# paragraph after the table says: the proto, the kernels' CPU reference and ABI headers,
# common, the client half of server/fdpass and config/ (the rules and their proto
# conversions); never a service or the daemon.
CLIENT_MAY = ("client/", "kernels/", "arfuse/v1/", "common/", "common/fd/fd_channel_client",
              "common/fd/unique_fd", "config/")


def layer_table():
    section = PAGE.read_text().split("## Where the code lives", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] in ORDER:
            layers[cells[0]] = [f.rstrip("/") + "/" for f in re.findall(r"`([^`(]+/?)`", cells[1])
                                if "/" in f or f.endswith("/")]
    assert list(layers) == ORDER, f"the layer table of {PAGE.name} changed: {list(layers)}"
    return layers


def layer_of(path, layers):
    """(rank, folder) of the longest folder of the table holding path, or None."""
    best = None
    for rank, name in enumerate(ORDER):
        for folder in layers[name]:
            if path.startswith(folder) and (best is None or len(folder) > len(best[1])):
                best = (rank, folder)
    return best


def tree_includes():
    files = [f for top in ("kernels", "server", "client", "bench") for f in (REPO / top).rglob("*")]
    for f in sorted(files):
        rel = f.relative_to(REPO).as_posix()
        if f.suffix not in SOURCES or not f.is_file() or "/build/" in rel:
            continue
        for inc in INCLUDE.findall(f.read_text(errors="replace")):
            yield rel, inc


def test_each_layer_includes_only_the_layers_below_it():
    layers = layer_table()
    upward = []
    for rel, inc in tree_includes():
        here, there = layer_of(rel, layers), layer_of(inc, layers)
        if here is None or there is None:
            continue
        if there[0] > here[0]:
            upward.append(f"{rel} includes {inc} ({ORDER[there[0]]} above {ORDER[here[0]]})")
        # Binaries sit side by side: none includes another's sources.
        if here[0] == there[0] == ORDER.index("binaries") and here[1] != there[1]:
            upward.append(f"{rel} includes {inc} (another binary's sources)")
    assert not upward, "\n".join(upward)


def test_the_server_libraries_include_no_grpc():
    layers = layer_table()
    found = [f"{rel} includes {inc}" for rel, inc in tree_includes()
             if (layer_of(rel, layers) or (None,))[0] == ORDER.index("server libraries")
             and inc.startswith(("grpcpp/", "grpc/", "grpc++/"))]
    assert not found, "\n".join(found)


def test_the_client_side_includes_only_what_the_page_names():
    found = [f"{rel} includes {inc}" for rel, inc in tree_includes()
             if rel.startswith("client/") and not rel.startswith("tools/arfusectl/")
             and inc.startswith(("server/", "kernels/", "client/", "bench/"))
             and not inc.startswith(CLIENT_MAY)]
    assert not found, "\n".join(found)


def test_a_planted_upward_include_is_caught():
    layers = layer_table()
    here, there = layer_of("kernels/cpu/x.cc", layers), layer_of("common/log.h", layers)
    assert here[0] < there[0]
    assert layer_of("server/services/fusion/x.cc", layers)[1] == "server/services/"
