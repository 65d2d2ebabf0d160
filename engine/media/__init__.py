"""Images in prompts: per-family layouts (``families``), one call's images with their content ids and block key
material (``inputs``), and the vision-encoder cache (``encoder_cache``). docs/multimodal.md."""
