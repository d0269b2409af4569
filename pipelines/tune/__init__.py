"""``relaunch tune`` on this machine: the trials of a study run as local processes (:mod:`.runner`) and
what is printed about them (:mod:`.console`); the command itself is :mod:`relaunch.pipelines.commands.tune`,
the study machinery :mod:`relaunch.components.core.tuning`."""
