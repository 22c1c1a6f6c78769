"""Prometheus metrics of real sidecars, scraped over HTTP after eager ops ran."""
import os
import re
import urllib.request

import arfuse
from conftest import Group
from test_client import F32, H, T, input_value, run_ranks, wait_ready


def test_ops_show_up_in_the_scrape(arfused):
    group = Group(arfused, 2, extra_args=("--metrics-port=0", "--log-level=info"))
    try:
        def rank(r):
            with arfuse.Client(group.socket(r)) as c:
                wait_ready(c)
                ws = arfuse.FusionWorkspace(c)
                buf = arfuse.HostShmBuffer(4 * T * H * F32)
                ws.register(buf, "tensors")
                x = buf.view("fp32", T * H, 0)
                res = buf.view("fp32", T * H, T * H * F32)
                y = buf.view("fp32", T * H, 2 * T * H * F32)
                g = buf.view("fp32", H, 3 * T * H * F32)
                for i in range(T * H):
                    x[i] = input_value(r, i)
                for i in range(H):
                    g[i] = 1.0
                for _ in range(3):
                    assert arfuse.allreduce_fusion(input=x.reshape(T, H), workspace=ws,
                                                   residual_in=res, residual_out=res, norm_out=y,
                                                   rms_gamma=g) is y
                for v in (x, res, y, g):
                    v.release()
                buf.close()

        run_ranks(rank, 2)
        log = open(os.path.join(group.dir, "arfused.0.log")).read()
        port = int(re.search(r"event=listening .*metrics_port=(\d+)", log).group(1))
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        text = body.decode()
        m = re.search(r'arfuse_ops_total\{rank="0",backend="mnnvl",path="host",plane="eager",'
                      r'reason="dispatch",result="ok"\} (\d+)', text)
        assert m and int(m.group(1)) >= 3, text[:2000]
        assert re.search(r'arfuse_bytes_reduced_total\{rank="0",path="host"\} (\d+)', text)
        assert 'arfuse_ready{rank="0"} 1' in text
        assert 'arfuse_backend_info{rank="0",backend="mnnvl",fusion_enabled="true"} 1' in text
        assert 'arfuse_peers_ready{rank="0"} 2' in text
    finally:
        group.stop()
