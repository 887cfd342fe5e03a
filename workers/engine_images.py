"""Which container image a node's replicas run in when its engine runtime is Docker or Podman:
vllm-ascend's official image, tagged with the pinned release (settings.VLLM_ASCEND_VERSION, the
Makefile's VLLM_ASCEND_TAG) and the variant for the node's hardware and OS.

The variants are the suffixes vllm-ascend publishes at v0.23.0 (.github/workflows/
schedule_image_build_and_push.yaml: '', openeuler, a3, a3-openeuler, a5, a5-openeuler, 310p,
310p-openeuler; tags `type=pep440,pattern={{raw}}`, so `v0.23.0-a3`) and lists in
docs/source/installation.md "Set up using Docker". quick_start.md names the 950DT image `-950dt`,
which the workflow does not publish: `-a5` is the one that exists."""

from django.conf import settings

IMAGE_REPOSITORY = "quay.io/ascend/vllm-ascend"
AUTO = "auto"

#: the node setting's value -> (image tag suffix, hardware, OS), as upstream publishes and lists them.
VARIANTS: dict[str, tuple[str, str, str]] = {
    "a2": ("", "Atlas A2", "Ubuntu"),
    "openeuler": ("-openeuler", "Atlas A2", "openEuler"),
    "a3": ("-a3", "Atlas A3", "Ubuntu"),
    "a3-openeuler": ("-a3-openeuler", "Atlas A3", "openEuler"),
    "310p": ("-310p", "Atlas 300I DUO", "Ubuntu"),
    "310p-openeuler": ("-310p-openeuler", "Atlas 300I DUO", "openEuler"),
    "a5": ("-a5", "Atlas 950DT", "Ubuntu"),
    "a5-openeuler": ("-a5-openeuler", "Atlas 950DT", "openEuler"),
}
CHOICES = (AUTO, *VARIANTS)


def variant_choices() -> list[tuple[str, str]]:
    """(value, label) for the node page: "auto" first, then each published variant."""
    auto = (AUTO, "by the node's chips (Ubuntu images: 310P → -310p, 950 → -a5, else Atlas A2)")
    return [auto] + [(value, f"{image_tag(suffix)}: {hw}, {os_}") for value, (suffix, hw, os_) in VARIANTS.items()]


def suffix_for_chip(chip_name: str | None) -> str:
    """The Ubuntu image for an npu-smi chip name: Atlas 300I DUO's 310P chips have their own image
    (Dockerfile.310p), the Ascend 950 family the -a5 one (Dockerfile.a5, SOC ascend950dt_9582);
    anything else, the 910B (Atlas A2) image. A3 and openEuler hosts are chosen on the node's page:
    npu-smi's chip name does not tell A3 from A2, nor the container's OS."""
    chip = (chip_name or "").strip().upper().removeprefix("ASCEND").strip(" _-")
    if chip.startswith("310P"):
        return "-310p"
    if chip.startswith("950"):
        return "-a5"
    return ""


def image_tag(suffix: str) -> str:
    return f"v{settings.VLLM_ASCEND_VERSION}{suffix}"


def ascend_image(choice: str, chip_name: str | None) -> str:
    """The full image reference for a node's variant (or auto: by its chip)."""
    suffix = VARIANTS[choice][0] if choice in VARIANTS else suffix_for_chip(chip_name)
    return f"{IMAGE_REPOSITORY}:{image_tag(suffix)}"
