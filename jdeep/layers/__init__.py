"""DeepSeek-V4 building blocks as pure functions of (params, inputs); see model-spec.md §3-§4."""
