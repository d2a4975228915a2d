"""The controller's machinery around pyinfra: the fact cache and batching, the host lock, the
sudo password's channel, staging, the daemon-reload guard, the inventory as the tools take it."""
