"""Our guarantees for models trained by other tools (docs/other-trainers.md).

``seal``: seal a checkpoint folder another tool wrote, check it, find the newest that
verifies (torch-free; accelerate's ``save_state`` folders use it directly).
``transformers``: ``SealedCheckpoints``, the Trainer callback that seals every ``checkpoint-N``
(the optional extra ``transformers``). Staging such a folder is ``pipeline.stage.from_folder``.
Nothing is imported here, so ``seal`` never pulls in transformers.
"""
