"""Qwen2VLImageTextProcessor: transformers' Qwen2VLProcessor without its video processor, for Qwen-Image-Edit's
tiny pipelines (parts.qwen_vl_processor), which hand their processor text and images, never a video.

Why it exists: transformers' Qwen2VLProcessor holds an image processor, a tokenizer and a video processor, and
checks each one's class when it is built or loaded. Without torchvision (transformers 5.25 on a CPU machine) the
video processor's check fails before it looks at the argument (`VIDEO_PROCESSOR_MAPPING has no attribute
_extra_content`), whatever is given, even None: the stock class cannot be built there at all, while its image
processor has a PIL version (Qwen2VLImageProcessorPil).

What transformers allows: a processor's sub-processors are the arguments of its __init__
(ProcessorMixin.get_attributes), and ProcessorMixin.__call__ processes videos only `if videos is not None and
hasattr(self, "video_processor")`. This subclass's __init__ takes no video processor, so it has none; images
still go through the same image processor and the text through the same tokenizer, with Qwen2VLProcessor's own
image-token expansion (replace_image_token). Nothing of the image or text processing changes.

A pipeline folder's model_index.json names this module as the component's library. diffusers' from_pretrained
will not import a module a folder names, only use one already imported: load_pipeline's folder reader imports it
(model_folder, asking which components hold weights), and a plain DiffusionPipeline.from_pretrained (a test's
reference) needs `import xdit_lab.tiny.qwen_vl_processor` first. diffusers then finds ProcessorMixin among this
module's names (imported here) and loads the processor with its from_pretrained: the tiny folder and the
reference built from it hold the same processor.
"""

from transformers import ProcessorMixin, Qwen2VLProcessor

__all__ = ["ProcessorMixin", "Qwen2VLImageTextProcessor"]


class Qwen2VLImageTextProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor with an image processor and a tokenizer, no video processor (the module says why)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # Qwen2VLProcessor hands (image_processor, tokenizer, video_processor) on, and ProcessorMixin pairs them with
        # get_attributes(), image_processor and tokenizer here: the None in the video processor's place pairs with none
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
