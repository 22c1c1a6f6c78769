"""The include rules of docs/architecture.md ("Where the code lives"), checked on the tree: each
layer includes only the layers its row names, the layers below the services include no gRPC, and
neither the client SDK nor the tools include anything of server/. The layer table is read from
the page, so the page and the tree cannot drift apart silently."""
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "architecture.md"
SOURCES = (".h", ".hpp", ".cc", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+["<]([^">]+)[">]', re.M)
ORDER = ["common", "kernels", "config", "server libraries", "client SDK", "gRPC services",
         "binaries"]
# The top-level folders whose sources the checks read, and the tree's own include prefixes.
TOPS = ("common", "kernels", "config", "server", "client", "tools", "bench")
TREE = ("common/", "kernels/", "config/", "server/", "client/", "tools/", "bench/", "tests/")
# Layers without gRPC: everything below the services.
NO_GRPC = ("common", "kernels", "config", "server libraries")

# What the client SDK and the tools may include of the tree, as the paragraph after the table
# says: the proto, the kernels' CPU reference and ABI headers, common/ and config/; the tools also
# the SDK. Never server/.
CLIENT_MAY = ("client/", "kernels/", "arfuse/v1/", "common/", "config/")
TOOLS_MAY = CLIENT_MAY + ("tools/",)


def layer_table():
    """{layer: (folders, layers it may include)}, in the table's order."""
    section = PAGE.read_text().split("## Where the code lives", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] in ORDER:
            folders = [f.rstrip("/") + "/" for f in re.findall(r"`([^`(]+/?)`", cells[1])
                       if "/" in f or f.endswith("/")]
            below = [] if cells[2] == "none" else [n.strip() for n in cells[2].split(",")]
            layers[cells[0]] = (folders, below)
    assert list(layers) == ORDER, f"the layer table of {PAGE.name} changed: {list(layers)}"
    for name, (_, below) in layers.items():
        for other in below:
            assert other in ORDER[:ORDER.index(name)], f"{name} names {other!r}: not a row above it"
    return layers


def layer_of(path, layers):
    """(layer, folder) of the longest folder of the table holding path, or None."""
    best = None
    for name, (folders, _) in layers.items():
        for folder in folders:
            if path.startswith(folder) and (best is None or len(folder) > len(best[1])):
                best = (name, folder)
    return best


def tree_includes():
    files = [f for top in TOPS for f in (REPO / top).rglob("*")]
    for f in sorted(files):
        rel = f.relative_to(REPO).as_posix()
        if f.suffix not in SOURCES or not f.is_file() or "/build/" in rel:
            continue
        for inc in INCLUDE.findall(f.read_text(errors="replace")):
            yield rel, inc


def test_each_layer_includes_only_the_layers_its_row_names():
    layers = layer_table()
    wrong = []
    for rel, inc in tree_includes():
        here, there = layer_of(rel, layers), layer_of(inc, layers)
        if here is None or there is None:
            continue
        if here[0] != there[0] and there[0] not in layers[here[0]][1]:
            wrong.append(f"{rel} includes {inc} ({here[0]} does not include {there[0]})")
        # Binaries sit side by side: none includes another's sources.
        if here[0] == there[0] == "binaries" and here[1] != there[1]:
            wrong.append(f"{rel} includes {inc} (another binary's sources)")
    assert not wrong, "\n".join(wrong)


def test_the_layers_below_the_services_include_no_grpc():
    layers = layer_table()
    found = [f"{rel} includes {inc}" for rel, inc in tree_includes()
             if (layer_of(rel, layers) or (None,))[0] in NO_GRPC
             and inc.startswith(("grpcpp/", "grpc/", "grpc++/"))]
    assert not found, "\n".join(found)


def test_the_client_sdk_includes_only_what_the_page_names():
    found = [f"{rel} includes {inc}" for rel, inc in tree_includes()
             if rel.startswith("client/") and inc.startswith(TREE) and not inc.startswith(CLIENT_MAY)]
    assert not found, "\n".join(found)


def test_the_tools_include_only_what_the_page_names():
    found = [f"{rel} includes {inc}" for rel, inc in tree_includes()
             if rel.startswith("tools/") and inc.startswith(TREE) and not inc.startswith(TOOLS_MAY)]
    assert not found, "\n".join(found)


def test_nothing_of_the_server_on_the_client_side():
    server = [f"{rel} includes {inc}" for rel, inc in tree_includes()
              if rel.startswith(("client/", "tools/")) and inc.startswith("server/")]
    assert len(server) == 0, "\n".join(server)


def test_a_planted_wrong_include_is_caught():
    layers = layer_table()
    # Upward: a kernel including the server.
    here, there = layer_of("kernels/host/x.cc", layers), layer_of("server/fdpass/wake_fd.h", layers)
    assert there[0] not in layers[here[0]][1]
    # Side by side: common/ and kernels/, the client SDK and the server libraries.
    assert layer_of("common/log.h", layers)[0] not in layers["kernels"][1]
    assert layer_of("kernels/common/op_types.h", layers)[0] not in layers["common"][1]
    assert layer_of("server/peers/x.h", layers)[0] not in layers["client SDK"][1]
    assert layer_of("client/cpp/client.h", layers)[0] not in layers["server libraries"][1]
    assert layer_of("server/services/fusion/x.cc", layers)[1] == "server/services/"
    assert layer_of("common/fd/fd_wire.h", layers)[0] == "common"


def test_every_folder_the_table_names_exists():
    # A folder renamed or moved without the table is a row that checks nothing.
    missing = [f"{name}: {folder}" for name, (folders, _) in layer_table().items()
               for folder in folders if not (REPO / folder).is_dir()]
    assert not missing, "\n".join(missing)
