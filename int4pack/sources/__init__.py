"""Where a checkpoint's bytes come from, before any format is read: the folder or hub repo
(source_folder), the safetensors header (safetensors_header), the checkpoint's config, index and
mapped tensors (checkpoint), the GGUF and MLX containers presented as one (gguf_checkpoint,
gguf_config, mlx_checkpoint, derived_tensors), and which container opens a source (containers).
The format readers (int4pack/formats/) read their tensors through these. Nothing is imported here:
each module loads on first use, as the CLI's start needs.
"""
