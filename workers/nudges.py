"""Nudges: a Redis pub/sub message that wakes a node's agent to reconcile now (it also polls).
Both sides import this: whoever changes desired state publishes, the agent subscribes."""

import logging

import django_rq

log = logging.getLogger("console.agent")


def channel(node_name: str) -> str:
    return f"console:agent:{node_name}"


def publish(node_name: str) -> None:
    """Wake the node's agent; a lost nudge only costs one polling interval."""
    try:
        django_rq.get_connection("default").publish(channel(node_name), "reconcile")
    except Exception as exc:  # the agent polls anyway
        log.info("nudge for %s not sent: %s", node_name, exc)


def subscribe(node_name: str):
    """A pub/sub handle on the node's channel (raises when Redis is down)."""
    pubsub = django_rq.get_connection("default").pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(channel(node_name))
    return pubsub
