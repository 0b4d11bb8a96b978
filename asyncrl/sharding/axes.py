"""The trainer mesh's axis names, defined once: the mesh, the batch shardings and the fused logprob kernel read
them from here."""

MESH_AXES = ("dp", "fsdp", "expert", "cp")
EXPERT_AXIS = "expert"
"""The mesh axis a mixture-of-experts layer's experts split over (expert parallelism); the logical axis "expert"
maps to it. Outside the MoE layers it is one more data axis: the batch splits over it too."""
DATA_AXES = ("dp", "fsdp", EXPERT_AXIS)
"""Mesh axes that split the batch dim."""
CP_AXIS = "cp"
"""The mesh axis that splits the sequence dim (Ulysses context parallelism); the logical axis "seq" maps to it."""
TOKEN_AXES = (*DATA_AXES, CP_AXIS)
"""Mesh axes that split flattened [B*T] tokens: a sequence-split batch is still split over cp once flattened."""
