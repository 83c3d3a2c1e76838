import sys

from megatron_trace.quality.measure import main

sys.exit(main())
