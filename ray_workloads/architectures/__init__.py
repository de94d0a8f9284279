"""The models rayline runs: ``build`` (modules built by name and their weights loaded safely),
``torchvision_families``, ``timm_models`` and ``factory_models`` (where each kind comes from),
``shipped_code`` (a factory's ``--code`` zip, verified in this user's own cache), and
``model_files`` (TorchScript, ``.pt2`` and ONNX run as saved).

Imports no other stage package.
"""
