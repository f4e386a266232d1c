"""OpenAI-compatible HTTP server: ``pagedspec serve [MODEL]`` (or ``python -m pagedspec.serve``).
It drives ``LLMEngine`` from one engine thread (``async_engine``) and speaks HTTP; the engine
below it never knows a server exists.

Command line (stable; the serving benchmark and the soak drive it)::

    pagedspec serve [MODEL] [--model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY]
        [--served-model-name NAME] [--max-queue 256] [--shutdown-timeout 30]
        [--<every EngineConfig field>] [--speculative-method ngram|draft|eagle ...]

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` (200 while serving, 503 once shutting down or the engine has stopped),
``GET /metrics`` (Prometheus).

Metrics (stable names; vLLM's ``vllm:`` ones under our ``pagedspec:`` prefix):
``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc``,
``kv_cache_used_blocks``, ``kv_cache_total_blocks`` (gauges); ``prefix_cache_queries_total``,
``prefix_cache_hits_total`` (tokens), ``prompt_tokens_total``, ``generation_tokens_total``,
``num_preemptions_total``, ``spec_decode_num_draft_tokens_total``,
``spec_decode_num_accepted_tokens_total``, ``request_success_total{finished_reason}``,
``request_rejected_total{status}`` (counters); ``time_to_first_token_seconds``,
``inter_token_latency_seconds``, ``e2e_request_latency_seconds`` (histograms).

Files: ``cli`` (flags), ``protocol`` (bodies), ``async_engine`` (the engine thread),
``request_group`` (one HTTP request's engine requests), ``completions`` / ``chat`` /
``logprobs`` / ``serving`` (OpenAI formats), ``sse`` (disconnect-aware responses), ``metrics``,
``app`` (routes and errors), ``__main__`` (start and SIGTERM).
"""
