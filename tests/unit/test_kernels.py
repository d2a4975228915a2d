"""gpufleet/kernels: the headers metapackage that follows the running kernel's flavour."""
import pytest

from gpufleet.catalog.kernels import headers_metapackage, image_metapackage, kernel_flavour

pytestmark = pytest.mark.unit

# `uname -r` as Debian's and Ubuntu's kernel packages name their releases (package lists of
# bookworm, trixie, bookworm-backports, noble), and this CI machine's own kernel.
RECORDED = {
    "6.1.0-27-amd64": "amd64",
    "6.1.0-27-cloud-amd64": "cloud-amd64",
    "6.1.0-27-rt-amd64": "rt-amd64",
    "6.1.0-27-arm64": "arm64",
    "6.1.0-27-cloud-arm64": "cloud-arm64",
    "6.1.0-27-686-pae": "686-pae",
    "5.10.0-32-amd64": "amd64",
    "6.12.48+deb13-amd64": "amd64",
    "6.12.48+deb13-cloud-amd64": "cloud-amd64",
    "6.12.48+deb13-rt-amd64": "rt-amd64",
    "6.12.12+bpo-amd64": "amd64",
    "6.12.12+bpo-cloud-amd64": "cloud-amd64",
    "6.8.0-45-generic": "generic",
    "6.8.0-1015-aws": "aws",
    "6.8.0-1014-azure": "azure",
    "5.15.0-1060-nvidia": "nvidia",
    "6.18.44-fc-v1045": None,       # the CI machine (test hosts share it)
    "6.6.87.2-microsoft-standard-WSL2": None,
    "6.1.0-27-amd64-custom": None,
    "": None,
}


@pytest.mark.parametrize("release,flavour", RECORDED.items())
def test_flavour_from_release(release, flavour):
    assert kernel_flavour(release) == flavour
    assert headers_metapackage(release) == (f"linux-headers-{flavour}" if flavour else None)
    assert image_metapackage(release) == (f"linux-image-{flavour}" if flavour else None)


def test_none_release():
    assert kernel_flavour(None) is None and headers_metapackage(None) is None
