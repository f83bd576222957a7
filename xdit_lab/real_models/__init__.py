"""Header-only diffusers folders of real models: every shape of a published checkpoint, no weights.

A planner that says which configuration of FLUX.1-dev fits two 24 GB cards must be proven on
FLUX.1-dev's real shapes, but the weights are 33 GB and nothing here may download them. So the
folders are rebuilt from the published configurations (/work/shared/REAL-MODELS.md):

    folder/model_index.json                  as a diffusers folder lists its components
    folder/<component>/config.json           as the class itself saves it (built on the meta device)
    folder/<component>/*.safetensors         a real safetensors header, then a sparse hole:

        | 8-byte header length | JSON header: each tensor's dtype, shape, data_offsets | hole ... |
                                                                    f.truncate(8 + header + data)

The file is as long as the real one, so safetensors' own reader and the memory plan read it as
the real file, while the hole occupies no disk (`du` counts only the headers). Reading a tensor
gives zeros. Two traps of the published files are kept: a tied weight is stored once (T5's
`shared` and `encoder.embed_tokens`), and persistent buffers are saved beside the parameters
(SD3.5-large's `pos_embed`, 89,653,248 elements). Tokenizers are listed in model_index.json, as
in the published folders, but not written (their vocabularies cannot be rebuilt here): these
folders are for planning, not for loading. Every file is written under a temporary name and
renamed into place, so an interrupted build never leaves a half-written file under a real name.

    save_header_only("FLUX.1-dev", "models/flux-dev")   # ~1 s, a few hundred KB on disk
"""

from .header_only import (
    build_on_meta,
    save_header_only,
    stored_tensors,
    write_header_only_safetensors,
    write_header_only_weights,
)
from .table import REAL_MODELS, Component, RealModel

__all__ = [
    "REAL_MODELS",
    "Component",
    "RealModel",
    "build_on_meta",
    "save_header_only",
    "stored_tensors",
    "write_header_only_safetensors",
    "write_header_only_weights",
]
