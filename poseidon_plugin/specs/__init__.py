"""Planning inputs: cluster, model + job, and profile specs, their presets and the analytic profile.

Public API::

    load_cluster(name_or_path) -> ClusterSpec      # YAML/JSON file or preset ("paper-setting-3")
    load_model(name_or_path) -> ModelSpec          # YAML/JSON file or preset ("llama3-70b")
    load_profile(path) -> ProfileSpec; write_profile(path, profile)   # JSON, atomic write
    analytic_profile(cluster, model, micro_batch_sizes=(1, 2, 4, 8)) -> ProfileSpec
    list_presets() -> {"clusters": [...], "models": [...], "devices": [...]}
    CostConstants: the cost model's named, overridable constants

Schemas: docs/SPECS.md. Nothing here imports torch.
"""

from .analytic import (analytic_entry, analytic_profile, constants_for, layer_activation_bytes,
                       layer_forward_flops, layer_param_counts, valid_tp_degrees)
from .cluster import (LINK_CROSS_TYPE, LINK_INTER_NODE, LINK_INTRA_NODE, LINK_NAMES, ClusterSpec,
                      Device, DeviceType, LinkSpec, NodeGroup, cluster_presets, device_presets,
                      load_cluster, parse_cluster)
from .constants import GIB, CostConstants, DEFAULT_CONSTANTS, resolve_constants
from .model import DTYPE_BYTES, ModelSpec, load_model, model_presets, parse_model
from .profile import (PROFILE_FORMAT, PROFILE_VERSION, ProfileEntry, ProfileSpec, load_profile,
                      merge_profiles, parse_profile, write_profile)


def list_presets() -> dict[str, tuple[str, ...]]:
    """Built-in preset names by kind."""
    return {"clusters": cluster_presets(), "models": model_presets(), "devices": device_presets()}


__all__ = [
    "ClusterSpec", "CostConstants", "DEFAULT_CONSTANTS", "DTYPE_BYTES", "Device", "DeviceType", "GIB",
    "LINK_CROSS_TYPE", "LINK_INTER_NODE", "LINK_INTRA_NODE", "LINK_NAMES", "LinkSpec", "ModelSpec",
    "NodeGroup", "PROFILE_FORMAT", "PROFILE_VERSION", "ProfileEntry", "ProfileSpec", "analytic_entry",
    "analytic_profile", "cluster_presets", "constants_for", "device_presets", "layer_activation_bytes",
    "layer_forward_flops", "layer_param_counts", "list_presets", "load_cluster", "load_model",
    "load_profile", "merge_profiles", "model_presets", "parse_cluster", "parse_model", "parse_profile",
    "resolve_constants", "valid_tp_degrees", "write_profile",
]
