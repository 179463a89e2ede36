"""The engine deployment's request router: Ray's `PrefixCacheAffinityRouter`, for requests
that carry no prompt too.

Ray's router divides by the prompt's length, so a request without one (a health probe,
/v1/models, /metrics) failed routing with ZeroDivisionError and was never answered. Those go
through the power of two choices (Serve's default router, load only) and leave nothing in the
prefix tree; prompts are routed by Ray's code unchanged. Imported by Serve on the ingress's
side, by the path in `ray_app.PREFIX_ROUTER`.
"""

from __future__ import annotations

from typing import Any

# Ray's router lives under ray.llm's internal path: `ray.serve.llm` re-exports it but imports
# vLLM, which tallow does not install (checked with ray 2.60.0, which tallow[ray] pins).
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter


def _has_prompt(pending_request: Any) -> bool:
    args = getattr(pending_request, "args", None) or ()
    return any(getattr(arg, "prompt", "") for arg in args)


class PromptPrefixRouter(PrefixCacheAffinityRouter):
    async def choose_replicas(self, candidate_replicas, pending_request=None):  # type: ignore[override]
        if pending_request is not None and not _has_prompt(pending_request):
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(
                self, candidate_replicas=candidate_replicas, pending_request=pending_request
            )
        return await super().choose_replicas(candidate_replicas, pending_request)

    def on_request_routed(self, pending_request, replica_id, result) -> None:  # type: ignore[override]
        if pending_request is not None and _has_prompt(pending_request):
            super().on_request_routed(pending_request, replica_id, result)
