"""The node page shows the interface variables for multi-node collectives that the node's agent recorded
from its NODE_INTERFACES setting (Node.settings["interfaces"]), escaped, and says how to set them when none are."""

import pytest

from workers.agent import NodeAgent
from workers.models import Node


@pytest.mark.django_db
def test_the_node_page_shows_the_interfaces_the_agent_recorded(settings, tmp_path, as_viewer):
    settings.DATA_DIR = tmp_path
    settings.NODE_INTERFACES = {
        "HCCL_IF_IP": "10.0.0.5",
        "GLOO_SOCKET_IFNAME": "enp189s0f0",
        "TP_SOCKET_IFNAME": "<b>eth0</b>",
    }  # not checked by the agent: must be escaped
    node = NodeAgent("npu-a", engine_python=str(tmp_path / "no-engine" / "python")).register()
    assert Node.objects.get(pk=node.pk).settings["interfaces"] == settings.NODE_INTERFACES
    page = as_viewer.get(f"/nodes/{node.pk}/").content.decode()
    shown = page.split('id="node-interfaces">', 1)[1].split("</dd>", 1)[0]
    assert "<code>GLOO_SOCKET_IFNAME=enp189s0f0</code> · <code>HCCL_IF_IP=10.0.0.5</code>" in shown  # by name
    assert "<code>TP_SOCKET_IFNAME=&lt;b&gt;eth0&lt;/b&gt;</code>" in shown and "<b>eth0" not in page
    assert "NODE_INTERFACES=" not in shown

    # The agent restarted without the setting: none recorded, and the page says where to set them.
    settings.NODE_INTERFACES = {}
    NodeAgent("npu-a", engine_python=str(tmp_path / "no-engine" / "python")).register()
    shown = (
        as_viewer.get(f"/nodes/{node.pk}/").content.decode().split('id="node-interfaces">', 1)[1].split("</dd>", 1)[0]
    )
    assert "none set" in shown and "<code>NODE_INTERFACES=HCCL_IF_IP=" in shown and "agent environment" in shown
    assert "<code>HCCL_IF_IP=10.0.0.5</code>" not in shown
