from tests.support import hypothesis_profiles

hypothesis_profiles.load()  # "ci" unless HYSCALE_HYPOTHESIS_PROFILE says otherwise
