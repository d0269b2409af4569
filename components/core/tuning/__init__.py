"""A study of relaunch trainings (``relaunch tune``; the cluster's tuning pipeline): its folders and records
in the store (:mod:`.layout`), its Optuna storage, seeded per-trial sampler and pruner (:mod:`.study`), its
trials as trainings that resume (:mod:`.trials`), its MLflow run with the best trial and the plots
(:mod:`.report`). Each trial is a whole relaunch training in ``<store.uri>/studies/<study>/trials/<n>/``."""
