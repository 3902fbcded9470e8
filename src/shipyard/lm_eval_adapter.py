"""`python -m shipyard.lm_eval_adapter --model shipyard ...`: lm-eval's command line with the `shipyard`
model registered. The adapter itself is shipyard.eval.lm_eval; this name stays because users type it."""

from shipyard.eval.lm_eval import ShipyardLM, main

__all__ = ["ShipyardLM", "main"]

if __name__ == "__main__":
    main()
