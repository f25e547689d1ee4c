"""Lets lm-evaluation-harness find ferrum's model by name (``lm_eval --model ferrum``).

lm_eval knows only the models its own ``lm_eval.models`` lists, and looks for no plugins. This
module, imported at interpreter start by ``ferrum-lm-eval.pth``, watches for that module to be
imported and then adds ``ferrum`` to lm_eval's model registry as a lazy reference to
``ferrum.lm_eval_model:FerrumLM``: nothing of ferrum (nor of lm_eval) is imported before lm_eval
itself asks for the model. Until then it costs one string comparison per import.

PYTEST_DONT_REWRITE: pytest would rewrite the asserts of a plugin distribution's modules, and warn
that this one, imported at start-up, is too late for that (it has none).
"""
import importlib.abc
import importlib.machinery
import sys

WATCHED = "lm_eval.models"
MODEL = ("ferrum", "ferrum.lm_eval_model:FerrumLM")


class _RegisterWhenLoaded(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != WATCHED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load = spec.loader.exec_module

        def load_then_register(module):
            load(module)
            from lm_eval.api.registry import model_registry
            if MODEL[0] not in model_registry:
                model_registry.register(MODEL[0], target=MODEL[1])
        spec.loader.exec_module = load_then_register
        return spec


if not any(isinstance(f, _RegisterWhenLoaded) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenLoaded())
