"""The local run: kfp.local with relaunch's fixes, the warm step servers, the console."""
