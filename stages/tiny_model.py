"""The ``tiny_model`` stage: the embedded tiny model (``stages.common.tiny``) as a pipeline stage.

Run: ``python -m stages.tiny_model recipes/base/tiny.yaml [key=value ...]``
"""

from __future__ import annotations

from stages.common.stage import StageSpec, logged, print_result
from stages.common.tiny import (  # noqa: F401  (the factory, as this stage's module offers it)
    PRESETS,
    TinyModelConfig,
    build_model,
    build_tokenizer,
    run_tiny_model,
)


def main(argv: list[str] | None = None) -> None:
    print_result(SPEC, argv)


SPEC = StageSpec("tiny_model", TinyModelConfig, run_tiny_model, metrics=lambda config: logged(["parameters"]))

if __name__ == "__main__":
    main()
