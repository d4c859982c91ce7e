"""Serve a reward-model checkpoint over HTTP in OpenRLHF's remote-reward protocol.

``POST /get_reward`` with ``{"query": [text, ...], "prompts": [...]?, "labels": [...]?}`` answers
``{"rewards": [...], "scores": [...], "extra_logs": {}}``: each query (a prompt + response text, rendered as
in training) is tokenized with the checkpoint's tokenizer and scored at its last token, in batches of
``--batch-size``; rewards are normalised with the checkpoint's ``reward_mean``/``reward_std`` when it has
them (``--no-normalize``: raw scores). ``GET /health`` says what is served. The RL stage's ``reward.url``
(protocol ``openrlhf``) and OpenRLHF's ``--remote_rm_url`` talk to it unchanged.

It listens on 127.0.0.1 unless ``--host`` names another address; with ``--token-env NAME`` a request must
carry ``Authorization: Bearer <$NAME>``.

Run: ``python -m stages.serve_rm runs/reward_model-.../checkpoint [--port 5000] [--token-env RM_TOKEN]``
"""

from __future__ import annotations

import argparse
import hmac
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    query: list[str] = Field(min_length=1)
    prompts: list[str] | None = None
    labels: list[Any] | None = None


def make_app(checkpoint: str, normalize: bool | None = None, batch_size: int = 32, token: str | None = None):
    """The FastAPI app serving ``checkpoint`` (verified against its manifest first; a reward model only)."""
    from fastapi import FastAPI, Header, HTTPException
    from transformers import AutoTokenizer

    from checkpoints import load_ref, require_kind, verify
    from stages.common.scoring import RewardModelScorer

    ref = load_ref(checkpoint)
    verify(ref)
    require_kind(ref, ("reward",), "the model serve_rm serves")
    scorer = RewardModelScorer(ref.path, normalize, batch_size)
    tokenizer = AutoTokenizer.from_pretrained(ref.path)
    app = FastAPI(title="rlhf-pipeline reward model", version=ref.digest[:16])

    def check_token(authorization: str | None) -> None:
        if token is not None and not hmac.compare_digest(authorization or "", f"Bearer {token}"):
            raise HTTPException(status_code=401, detail="missing or wrong bearer token")

    @app.get("/health")
    def health(authorization: str | None = Header(default=None)) -> dict[str, Any]:
        check_token(authorization)
        return {"status": "ok", "checkpoint": ref.path, "digest": ref.digest, "normalized": scorer.norm is not None}

    @app.post("/get_reward")
    def get_reward(req: RewardRequest, authorization: str | None = Header(default=None)) -> dict[str, Any]:
        check_token(authorization)
        for name in ("prompts", "labels"):
            value = getattr(req, name)
            if value is not None and len(value) != len(req.query):
                raise HTTPException(status_code=422, detail=f"'{name}' has {len(value)} items for {len(req.query)} queries")
        ids = [tokenizer(q, add_special_tokens=False)["input_ids"] for q in req.query]
        empty = [i for i, s in enumerate(ids) if not s]
        if empty:
            raise HTTPException(status_code=422, detail=f"queries {empty[:10]} are empty")
        scores = scorer.score(ids)
        return {"rewards": scores, "scores": scores, "extra_logs": {}}

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(prog="python -m stages.serve_rm", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a reward-model checkpoint folder (the reward_model stage's output)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    ap.add_argument("--port", type=int, default=5000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                    help="(score - reward_mean) / reward_std from the checkpoint (default: when it has them)")
    ap.add_argument("--token-env", default=None, help="environment variable holding the bearer token clients must send")
    args = ap.parse_args(argv)
    token = None
    if args.token_env:
        token = os.environ.get(args.token_env)
        if not token:
            ap.error(f"--token-env: the environment variable {args.token_env} is not set (or empty)")
    app = make_app(args.checkpoint, args.normalize, args.batch_size, token)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
